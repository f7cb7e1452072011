"""Train the two small models shipped in `mixtral_infer/shipped/` on the King James Bible.

The trained folders (`tiny-mixtral`, `tiny-mistral`) are committed, so this script is only
needed to re-train them. It needs the public-domain KJV text from Debian:

    apt-get install bible-kjv-text        # also pulls in the `bible` reader program
    python scripts/train_small.py         # ~20 minutes on 2 idle CPU cores
    python scripts/train_small.py --quick # ~1 minute smoke run, writes to a temp folder

Steps:
  1. read the corpus (one verse per line), drop the verse references, hold out the last 2%;
  2. train a sentencepiece BPE tokenizer laid out like Mistral's (unk=0, bos=1, eos=2,
     byte fallback) on the training split;
  3. train a small Mixtral (4 experts, top-2) and a small dense Mistral with the package's own
     `Transformer`, on windows longer than the attention's sliding window;
  4. report held-out perplexity per token against an add-one unigram baseline, and save each
     model as `params.json`, `consolidated.safetensors`, `tokenizer.model`, `training.json`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import sentencepiece as spm
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mixtral_infer import ModelArgs, MoeArgs, Tokenizer, Transformer, generate, load_model  # noqa: E402
from mixtral_infer.checkpoint.loading import TOKENIZER_FILE, save_consolidated  # noqa: E402

DEFAULT_CORPUS = Path("/usr/lib/bible.data")  # installed by Debian's `bible-kjv-text`
CORPUS_NAME = "King James Bible (1611), Debian package bible-kjv-text"
WHOLE_BIBLE = "Gen1:1-Rev22:21"
DEFAULT_OUT_DIR = REPO_ROOT / "mixtral_infer" / "shipped"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# "Ge1:1 In the beginning..." or "1Jn4:8 He that loveth not..." -> the reference to strip.
VERSE_REFERENCE = re.compile(r"^\s*\d?\s*[A-Za-z][A-Za-z ]*\d+:\d+\s+")


# --------------------------------------------------------------------------- corpus


def read_corpus(path: Path) -> list[str]:
    """Return the corpus as a list of verses (one plain line each, references removed).

    `path` is either Debian's compressed `bible.data` (decoded with the `bible` program from
    the `bible-kjv` package) or a UTF-8 text file with one verse or paragraph per line.

    >>> VERSE_REFERENCE.sub("", "1Jn4:8 He that loveth not knoweth not God; for God is love.")
    'He that loveth not knoweth not God; for God is love.'
    """
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {path} not found: run `apt-get install bible-kjv-text`, "
            "or pass --corpus with a UTF-8 text file"
        )
    if path.name.endswith("bible.data"):
        text = decode_bible_data(path)
    else:
        text = path.read_text(encoding="utf-8")
    lines = (VERSE_REFERENCE.sub("", line).strip() for line in text.splitlines())
    return [" ".join(line.split()) for line in lines if line]


def decode_bible_data(path: Path) -> str:
    """Dump the whole Bible from Debian's compressed data file, one `Ref text` line per verse."""
    reader = shutil.which("bible")
    if reader is None:
        raise FileNotFoundError(
            "the `bible` program (Debian package bible-kjv) is needed to read " f"{path}"
        )
    command = [reader, "-f", "-p", str(path.parent), "-d", path.name, WHOLE_BIBLE]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not result.stdout:
        raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr or result.stdout}")
    return result.stdout


def split_corpus(lines: list[str], holdout_fraction: float) -> tuple[list[str], list[str]]:
    """Split off the last `holdout_fraction` of the lines (at least one) for evaluation."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"--holdout must be in (0, 1), got {holdout_fraction}")
    n_holdout = max(1, round(len(lines) * holdout_fraction))
    return lines[:-n_holdout], lines[-n_holdout:]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(lines: list[str], vocab_size: int, path: Path) -> spm.SentencePieceProcessor:
    """Train a BPE sentencepiece model with Mistral's special ids and byte fallback.

    Byte fallback makes any Unicode string encodable (unknown characters become `<0x..>`
    byte pieces), so `unk` is never produced.
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=-1,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        input_sentence_size=0,
        num_threads=2,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


@dataclass
class TokenStream:
    """A corpus split encoded as one stream of tokens (verses follow each other, as in prose).

    `line_starts[i]` is the index in `tokens` of the first token of line i.
    """

    tokens: torch.Tensor  # [N] int64
    line_starts: torch.Tensor  # [L] int64


def encode_lines(tokenizer: spm.SentencePieceProcessor, lines: list[str]) -> TokenStream:
    """Encode each line (no bos/eos) and concatenate; decoding gives the lines joined by spaces."""
    pieces = tokenizer.encode(lines)
    lengths = torch.tensor([len(p) for p in pieces])
    starts = torch.cumsum(lengths, 0) - lengths
    tokens = torch.tensor([t for p in pieces for t in p], dtype=torch.long)
    return TokenStream(tokens=tokens, line_starts=starts)


# --------------------------------------------------------------------------- models


def tiny_model_args(vocab_size: int, moe: bool) -> ModelArgs:
    """The shapes of the shipped models: 4 layers, GQA 4:2, window 32 (< training length)."""
    return ModelArgs(
        dim=128,
        n_layers=4,
        head_dim=32,
        hidden_dim=256 if moe else 384,
        n_heads=4,
        n_kv_heads=2,
        norm_eps=1e-5,
        vocab_size=vocab_size,
        max_batch_size=4,
        rope_theta=10000.0,
        sliding_window=32,
        moe=MoeArgs(num_experts=4, num_experts_per_tok=2) if moe else None,
    )


MODEL_NAMES = {"tiny-mixtral": True, "tiny-mistral": False}  # name -> has MoE


def init_weights(model: nn.Module, n_layers: int, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) everywhere, residual outputs (wo, w2) scaled by depth."""
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue  # norm weights keep their ones
        # Dense and stacked-expert names: "...attention.wo.weight", "...w2.weight", "...feed_forward.w2".
        residual_output = name.endswith(("wo.weight", "w2.weight", "feed_forward.w2"))
        scale = 1.0 / math.sqrt(2 * n_layers) if residual_output else 1.0
        nn.init.normal_(param, mean=0.0, std=std * scale)


class RouterStats:
    """Records the router logits of every MoE layer during forward passes (via hooks).

    Used for the Switch-Transformer load-balancing loss, which keeps all experts in use
    (without it a small MoE tends to send most tokens to one or two experts), and to report
    how tokens are shared between experts.
    """

    def __init__(self, model: nn.Module, top_k: int):
        self.top_k = top_k
        gates = [m for n, m in model.named_modules() if n.endswith("feed_forward.gate")]
        self.logits: list[list[torch.Tensor]] = [[] for _ in gates]  # per layer, per forward: [T, E]
        for layer, gate in enumerate(gates):
            gate.register_forward_hook(self._recorder(layer))

    def _recorder(self, layer: int) -> Callable:
        def record(_module: nn.Module, _inputs: tuple, logits: torch.Tensor) -> None:
            self.logits[layer].append(logits)

        return record

    @property
    def found_gates(self) -> bool:
        return len(self.logits) > 0

    def clear(self) -> None:
        for recorded in self.logits:
            recorded.clear()

    def pop_balance_loss(self) -> torch.Tensor:
        """Mean over layers of E * sum_e(share of routed slots_e * mean router probability_e);
        1.0 when routing is uniform, up to E when collapsed onto one expert."""
        losses = []
        for recorded in self.logits:
            logits = torch.cat(recorded)  # [T, E]
            n_experts = logits.shape[-1]
            chosen = torch.topk(logits, self.top_k, dim=-1).indices  # [T, K]
            share = torch.bincount(chosen.flatten(), minlength=n_experts).float() / chosen.numel()
            losses.append(n_experts * torch.sum(share * F.softmax(logits.float(), dim=-1).mean(0)))
        self.clear()
        return torch.stack(losses).mean()

    def pop_expert_shares(self) -> list[list[float]]:
        """Per layer, the share of routed token slots each expert got."""
        shares = []
        for recorded in self.logits:
            logits = torch.cat(recorded)
            chosen = torch.topk(logits, self.top_k, dim=-1).indices.flatten()
            counts = torch.bincount(chosen, minlength=logits.shape[-1]).float()
            shares.append([round(x, 3) for x in (counts / counts.sum()).tolist()])
        self.clear()
        return shares


# --------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    balance_coef: float
    seed: int
    log_every: int


def sample_batch(stream: TokenStream, batch_size: int, seq_len: int, rng: random.Random) -> torch.Tensor:
    """`batch_size` windows of `seq_len` tokens: bos, then the stream from a random line start.

    Starting at a line start matches inference, where a prompt is encoded with bos first.
    Returns [B, seq_len]; inputs are [:, :-1] and targets [:, 1:].
    """
    body = seq_len - 1
    last_start = len(stream.tokens) - body
    starts = stream.line_starts[stream.line_starts <= last_start]
    rows = []
    for _ in range(batch_size):
        start = int(starts[rng.randrange(len(starts))])
        rows.append(torch.cat([torch.tensor([BOS_ID]), stream.tokens[start : start + body]]))
    return torch.stack(rows)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay from `lr` to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def language_model_loss(model: Transformer, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, S] batch, fed as one flat ragged batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    seqlens = [inputs.shape[1]] * inputs.shape[0]
    logits = model(inputs.reshape(-1), seqlens)  # [B * (S - 1), V]
    return F.cross_entropy(logits.float(), targets.reshape(-1))


def train(model: Transformer, stream: TokenStream, config: TrainConfig, router: Optional[RouterStats]) -> dict:
    """Train in place with AdamW; returns a summary (losses, wall time, tokens per second)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    rng = random.Random(config.seed)
    model.train()
    start, recent = time.time(), []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        batch = sample_batch(stream, config.batch_size, config.seq_len, rng)
        loss = language_model_loss(model, batch)
        balance = router.pop_balance_loss() if router else torch.zeros(())
        optimizer.zero_grad(set_to_none=True)
        (loss + config.balance_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            elapsed = time.time() - start
            mean = sum(recent) / len(recent)
            print(
                f"  step {step + 1:5d}/{config.steps}  loss {mean:.3f}  ppl {math.exp(mean):7.1f}  "
                f"balance {balance.item():.3f}  lr {learning_rate(step, config):.2e}  {elapsed:6.0f}s",
                flush=True,
            )
            recent.clear()
    wall = time.time() - start
    tokens = config.steps * config.batch_size * (config.seq_len - 1)
    return {"wall_time_s": round(wall, 1), "train_tokens": tokens, "tokens_per_s": round(tokens / wall)}


# --------------------------------------------------------------------------- evaluation


def eval_windows(stream: TokenStream, seq_len: int) -> list[torch.Tensor]:
    """Cut the held-out stream into windows (bos + at most seq_len-1 tokens), starting at line
    starts where possible, so that every held-out token is predicted exactly once."""
    body = seq_len - 1
    starts = stream.line_starts.tolist() + [len(stream.tokens)]
    windows, begin = [], 0
    while begin < len(stream.tokens):
        fitting = [s for s in starts if begin < s <= begin + body]
        end = fitting[-1] if fitting else begin + body
        windows.append(torch.cat([torch.tensor([BOS_ID]), stream.tokens[begin:end]]))
        begin = end
    return windows


@torch.no_grad()
def model_perplexity(model: Transformer, stream: TokenStream, seq_len: int, batch_size: int = 16) -> float:
    """Perplexity per token of the held-out stream (each token predicted once, bos not counted)."""
    model.eval()
    windows = eval_windows(stream, seq_len)
    total_nll, total_tokens = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        inputs = torch.cat([w[:-1] for w in group])
        targets = torch.cat([w[1:] for w in group])
        logits = model(inputs, [len(w) - 1 for w in group])
        total_nll += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        total_tokens += len(targets)
    assert total_tokens == len(stream.tokens), "every held-out token is scored once"
    return math.exp(total_nll / total_tokens)


def unigram_perplexity(train_tokens: torch.Tensor, heldout_tokens: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of add-one smoothed unigram frequencies of the training split."""
    counts = torch.bincount(train_tokens, minlength=vocab_size).double() + 1.0
    log_probs = torch.log(counts / counts.sum())
    return math.exp(-log_probs[heldout_tokens].mean().item())


# --------------------------------------------------------------------------- saving


def save_model(model: Transformer, folder: Path, tokenizer_path: Path, dtype: torch.dtype) -> None:
    """Write params.json and consolidated.safetensors (published tensor names, weights in
    `dtype`) with the package's `save_consolidated`, and copy the tokenizer next to them."""
    save_consolidated(copy.deepcopy(model).to(dtype), folder)
    shutil.copyfile(tokenizer_path, folder / TOKENIZER_FILE)


def sample_text(folder: Path, prompt: str, max_tokens: int, temperature: float) -> str:
    """Continue `prompt` with the saved model, through the package's public API."""
    model = load_model(folder, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer(folder / TOKENIZER_FILE)
    prompt_ids = tokenizer.encode(prompt, bos=True)
    generated, _ = generate([prompt_ids], model, max_tokens=max_tokens, temperature=temperature, seed=0)
    # Decode prompt and continuation together: decoding the continuation alone would drop the
    # space of its first piece ("▁unto" -> "unto"), as sentencepiece strips a leading space.
    return tokenizer.decode(prompt_ids + generated[0])


# --------------------------------------------------------------------------- main


@dataclass
class Corpus:
    """The tokenized corpus shared by both models."""

    tokenizer_path: Path
    vocab_size: int
    train: TokenStream
    heldout: TokenStream
    unigram_perplexity: float


def prepare_corpus(cli: argparse.Namespace, workdir: Path) -> Corpus:
    """Read and split the corpus, train the tokenizer, encode both splits, score the baseline."""
    lines = read_corpus(cli.corpus)
    train_lines, heldout_lines = split_corpus(lines, cli.holdout)
    print(f"corpus: {len(lines)} lines; training {len(train_lines)}, held out {len(heldout_lines)}")
    start = time.time()
    tokenizer_path = workdir / TOKENIZER_FILE
    tokenizer = train_tokenizer(train_lines, cli.vocab_size, tokenizer_path)
    train, heldout = encode_lines(tokenizer, train_lines), encode_lines(tokenizer, heldout_lines)
    print(
        f"tokenizer: vocab {tokenizer.vocab_size()}, trained in {time.time() - start:.0f}s; "
        f"{len(train.tokens)} training tokens, {len(heldout.tokens)} held out"
    )
    baseline = unigram_perplexity(train.tokens, heldout.tokens, tokenizer.vocab_size())
    print(f"unigram baseline held-out perplexity: {baseline:.1f}")
    return Corpus(tokenizer_path, tokenizer.vocab_size(), train, heldout, baseline)


def train_config(cli: argparse.Namespace, moe: bool) -> TrainConfig:
    return TrainConfig(
        steps=cli.steps,
        batch_size=cli.batch_size,
        seq_len=cli.seq_len,
        lr=cli.lr,
        min_lr_ratio=0.1,
        warmup_steps=min(cli.warmup_steps, cli.steps),
        weight_decay=cli.weight_decay,
        balance_coef=cli.balance_coef if moe else 0.0,
        seed=cli.seed,
        log_every=max(1, min(100, cli.steps // 10)),
    )


def train_and_save(name: str, cli: argparse.Namespace, corpus: Corpus) -> dict:
    """Train one model, save it, re-load the saved folder and evaluate that; returns the report."""
    torch.manual_seed(cli.seed)
    args = tiny_model_args(corpus.vocab_size, moe=MODEL_NAMES[name])
    model = Transformer(args)
    init_weights(model, args.n_layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n{name}: {n_params / 1e6:.2f}M parameters")
    router = RouterStats(model, args.moe.num_experts_per_tok) if args.moe else None
    if router is not None and not router.found_gates:
        raise RuntimeError("MoE model without `feed_forward.gate` modules: cannot balance the experts")
    config = train_config(cli, moe=router is not None)
    summary = train(model, corpus.train, config, router)
    if router is not None:
        router.clear()
    ppl_trained = model_perplexity(model, corpus.heldout, cli.seq_len)

    folder = cli.out_dir / name
    save_model(model, folder, corpus.tokenizer_path, getattr(torch, cli.save_dtype))
    shipped = load_model(folder, device="cpu", dtype=torch.float32)
    shipped_router = RouterStats(shipped, args.moe.num_experts_per_tok) if args.moe else None
    ppl = model_perplexity(shipped, corpus.heldout, cli.seq_len)
    print(
        f"  held-out perplexity: {name} {ppl:.2f} (before saving in {cli.save_dtype}: {ppl_trained:.2f}) "
        f"vs unigram {corpus.unigram_perplexity:.2f}"
    )
    report = {
        "name": name,
        "corpus": CORPUS_NAME,
        "heldout": f"last {cli.holdout:.0%} of the verses ({len(corpus.heldout.tokens)} tokens)",
        "heldout_perplexity": round(ppl, 2),
        "heldout_perplexity_before_saving": round(ppl_trained, 2),
        "unigram_heldout_perplexity": round(corpus.unigram_perplexity, 2),
        "parameters": n_params,
        "saved_dtype": cli.save_dtype,
        "tokenizer": {"type": "sentencepiece bpe", "vocab_size": corpus.vocab_size, "byte_fallback": True},
        "steps": config.steps,
        "config": dataclasses.asdict(config),
        "threads": cli.threads,
        **summary,
    }
    if shipped_router is not None:
        report["heldout_expert_shares_per_layer"] = shipped_router.pop_expert_shares()
    report["samples"] = {
        f"temperature {t}": sample_text(folder, SAMPLE_PROMPT, max_tokens=48, temperature=t) for t in (0.0, 0.8)
    }
    for label, text in report["samples"].items():
        print(f"  sample ({label}): {text}")
    (folder / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    size_kib = sum(f.stat().st_size for f in folder.iterdir()) / 1024
    print(f"  saved {folder} ({size_kib:.0f} KiB)")
    return report


SAMPLE_PROMPT = "And God said"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="bible.data or a UTF-8 text file, one verse per line (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=None, help=f"where the model folders go (default: {DEFAULT_OUT_DIR}; with --quick a new temp folder)")
    parser.add_argument("--models", nargs="+", choices=list(MODEL_NAMES), default=list(MODEL_NAMES))
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--holdout", type=float, default=0.02, help="fraction of lines (at the end) held out (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps per model (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128, help="training window, bos included (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--balance-coef", type=float, default=0.01, help="MoE load-balancing loss weight (default: %(default)s)")
    parser.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the saved weights (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run (~1 minute): 20 steps per model, temp output folder")
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.steps, cli.warmup_steps = 20, 5
        cli.out_dir = cli.out_dir or Path(tempfile.mkdtemp(prefix="train_small_quick_"))
    cli.out_dir = cli.out_dir or DEFAULT_OUT_DIR
    return cli


def main(argv: Optional[list[str]] = None) -> None:
    cli = parse_args(argv)
    torch.set_num_threads(cli.threads)
    start = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        corpus = prepare_corpus(cli, Path(workdir))
        reports = [train_and_save(name, cli, corpus) for name in cli.models]
    print("\nheld-out perplexity per token (unigram baseline {:.2f}):".format(corpus.unigram_perplexity))
    for report in reports:
        print(f"  {report['name']:14s} {report['heldout_perplexity']:8.2f}   trained in {report['wall_time_s']:.0f}s")
    print(f"total wall time {time.time() - start:.0f}s; models in {cli.out_dir}")


if __name__ == "__main__":
    main()
