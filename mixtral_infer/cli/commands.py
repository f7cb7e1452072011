"""The command line, parsed by fire::

    mixtral-infer demo [MODEL_PATH] [--prompt TEXT]...     complete prompts in one batch
    mixtral-infer interactive [MODEL_PATH] [--instruct]    a prompt loop that streams each answer
    mixtral-infer perplexity [MODEL_PATH] --text FILE      how well the model predicts a text
    mixtral-infer convert SRC DST [--to mistral|hf]        a model folder in the other layout
    mixtral-infer models                                   the shipped models, by name

Every function here only turns options into API calls and prints; errors of the
package are printed as one line, never as a traceback: exit code 2 for a command line that is
not one (an unknown command or option, an argument too many or missing: ``UsageError``), as
argparse and the shells do, 1 for the others (a value out of range, a file that cannot be read,
a model that cannot be loaded). torch and the
model code are imported when a command runs, so ``--help`` answers at once.

``--help`` shows each option's ``Type:`` (its annotation), ``Default:`` and the line of the
command's ``Args:`` section. So the commands' parameters are annotated with plain classes
(``top_k: int = None`` shows as ``Optional[int]``): fire prints ``Optional[str]`` as
``Optional[Optional]``, and a string annotation (``from __future__ import annotations``) as
its quoted text.
"""

import difflib
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import json as json_module  # demo's --json parameter hides the name json there
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from mixtral_infer.devices import DTYPE_NAMES
from mixtral_infer.errors import GenerationError, MixtralInferError
from mixtral_infer.hub import is_hub_name
from mixtral_infer.shipped import DEFAULT_MODEL_NAME, SHIPPED_MODELS, is_shipped, resolve_model_folder, shipped_models

if TYPE_CHECKING:
    from mixtral_infer.generation.sampling_params import SamplingParams

DEFAULT_MODEL = SHIPPED_MODELS / DEFAULT_MODEL_NAME
USAGE_EXIT = 2  # a command line that is not one (an unknown command or option): argparse's code


class UsageError(MixtralInferError):
    """The command line itself is wrong (an unknown option, an argument too many or missing): exit 2."""

DEMO_PROMPTS = [
    "In the beginning",
    "And the LORD spake unto Moses, saying,",
    "Blessed are",
]
MODEL_PATH_HELP = (
    "a model folder (Mistral: params.json + consolidated.safetensors; Hugging Face: config.json + "
    f"model.safetensors) or a shipped model's name ({', '.join(shipped_models())}; see `models`); default {DEFAULT_MODEL_NAME}"
)


def parse_dtype(name: Optional[str]):
    """The torch dtype called ``name``; None for None (the device's default)."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise GenerationError(f"--dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, name)


def check_quantize(quantize: Optional[str]) -> None:
    """``--quantize``'s value, said in the command line's spelling when it is wrong."""
    from mixtral_infer.quant.scheme import QuantScheme

    try:
        QuantScheme.parse(quantize)
    except MixtralInferError as error:
        raise type(error)(cli_spelling(str(error))) from None


def check_lora(lora: Optional[str], lora_scale: object, named: bool = False) -> List[Tuple[str, str]]:
    """``--lora``'s adapter exists and is of a format read here, ``--lora-scale`` is a number: said before any weight is read.
    ``named`` (``serve``): ``--lora NAME=PATH,...`` names adapters kept apart, served at once: their (name, path)
    pairs; ``[]`` for one adapter to merge, or none."""
    if lora is None:
        if lora_scale != 1.0:
            raise UsageError(f"--lora-scale {lora_scale!r} scales an adapter: give it with --lora PATH")
        return []
    if isinstance(lora, (list, tuple)) and named:
        lora = ",".join(map(str, lora))  # fire reads --lora a=x,b=y as one string, --lora [a=x,b=y] as a list
    if not isinstance(lora, str) or not lora:
        raise UsageError(f"--lora {lora!r}: give an adapter's folder or .safetensors file")
    from mixtral_infer.checkpoint.lora import check_adapter_path, parse_named_adapters

    try:
        pairs = parse_named_adapters(lora) if named and "=" in lora else []
        for path in [path for _, path in pairs] or [lora]:
            check_adapter_path(path, lora_scale)
    except MixtralInferError as error:
        raise type(error)(cli_spelling(str(error))) from None
    return pairs


def cli_spelling(message: str) -> str:
    """A library message in the command line's spelling: ``quantize='int3'`` as ``--quantize 'int3'``,
    ``quantize=`` as ``--quantize``, ``max_model_len`` as ``--max-model-len``."""
    message = re.sub(r"\b(quantize|max_tokens|max_model_len|dtype|device|decode|temperature|top_p|top_k|seed|chunk_size|lora_scale)=('[^']*'|\S+)",
                     lambda m: f"--{m[1].replace('_', '-')} {m[2]}", message)  # fmt: skip
    message = re.sub(r"\b(quantize|max_model_len)=(?=\s|$|\))", lambda m: f"--{m[1].replace('_', '-')}", message)
    return re.sub(r"(?<![\w-])--([a-z]+(?:_[a-z]+)+)", lambda m: "--" + m[1].replace("_", "-"), message)  # --max_tokens


def check_decode(decode: str) -> None:
    from mixtral_infer.generation.settings import DECODE_MODES

    if decode not in DECODE_MODES:
        raise GenerationError(f"--decode {decode!r} is not one of {', '.join(DECODE_MODES)}")


def parse_device(name: Optional[str]):
    """The device a model can run on: cpu, cuda[:N] where CUDA is available, mps where MPS is."""
    from mixtral_infer.devices import checked_device

    return checked_device(name, f"--device {name}")


def check_options(
    max_tokens: object,
    temperature: object,
    top_p: object,
    top_k: object,
    chunk_size: object,
    seed: object,
    device: object,
    dtype: object,
    tensor_parallel: object,
    num_pipeline_ranks: object,
) -> "SamplingParams":
    """Every option of demo / interactive, checked before the model is loaded (fire passes strings as
    they came); the sampling settings, as the object ``generate`` and the ``Conversation`` take."""
    from mixtral_infer.generation.sampling_params import SamplingParams
    from mixtral_infer.errors import as_int
    from mixtral_infer.generation.settings import check_chunk_size

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed).check()
    check_chunk_size(chunk_size)
    for name, value in (("tensor_parallel", tensor_parallel), ("num_pipeline_ranks", num_pipeline_ranks)):
        if as_int(value) is None or as_int(value) < 1:
            raise GenerationError(f"--{name} {value!r} must be an integer >= 1")
    if device is not None:
        parse_device(device)
    parse_dtype(dtype)
    return params


MAX_SPECULATIVE_TOKENS = 64  # generation.speculative's, without importing torch here


def check_speculative_options(
    draft_model: object, speculative_ngram: object, speculative_tokens: object, tensor_parallel: object = 1,
    num_pipeline_ranks: object = 1,
) -> None:
    """``--draft-model``, ``--speculative-ngram`` and ``--speculative-tokens``, checked before any model is loaded."""
    from mixtral_infer.errors import as_int

    if not isinstance(speculative_ngram, bool):
        raise UsageError(f"--speculative-ngram takes no value (got {speculative_ngram!r})")
    if draft_model is not None and speculative_ngram:
        raise GenerationError("give --draft-model or --speculative-ngram, not both")
    speculating = draft_model is not None or speculative_ngram
    if speculative_tokens is not None:
        if not speculating:
            raise GenerationError("--speculative-tokens needs --draft-model PATH or --speculative-ngram")
        k = as_int(speculative_tokens)
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise GenerationError(f"--speculative-tokens {speculative_tokens!r} must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}")
    if speculating and as_int(tensor_parallel) * as_int(num_pipeline_ranks) > 1:
        raise GenerationError("speculative decoding needs the whole model in one process: drop --draft-model/--speculative-ngram under torchrun")
    if draft_model is not None:
        if not isinstance(draft_model, str) or not draft_model:
            raise GenerationError(f"--draft-model {draft_model!r}: give a model folder or a shipped model's name")
        try:
            folder = model_folder(draft_model)
        except MixtralInferError as error:
            raise GenerationError(f"--draft-model {error}") from None
        if not folder.exists() and not is_hub_name(draft_model):
            raise GenerationError(f"--draft-model {draft_model}: no such folder or shipped model")


def load_draft(draft_model: Optional[str], speculative_ngram: bool, tokenizer, batch: int, device, dtype, max_tokens: int):
    """``generate``'s ``draft``: ``"ngram"``, a ``DraftModel`` of the model at ``draft_model`` (loaded as
    the model was, unquantized; its tokenizer must be the model's), or None."""
    if speculative_ngram:
        return "ngram"
    if draft_model is None:
        return None
    from mixtral_infer.generation.speculative import DraftModel

    draft, draft_tokenizer = load(draft_model, batch, device, dtype, max_tokens=max_tokens)
    sample = "In the beginning God created the heaven and the earth."
    if draft_tokenizer.n_words != tokenizer.n_words or draft_tokenizer.encode(sample) != tokenizer.encode(sample):
        raise GenerationError(f"--draft-model {draft_model}: its tokenizer is not the model's ({draft_tokenizer.n_words} "
                              f"tokens, the model's {tokenizer.n_words}); a draft must share it")  # fmt: skip
    return DraftModel(draft)


class ProgressBar:
    """A one-line progress bar on stderr, shown only for checkpoints with many tensors."""

    def __init__(self, label: str, width: int = 30):
        self.label, self.width = label, width

    def __call__(self, done: int, total: int) -> None:
        if total < 50 or not sys.stderr.isatty():
            return
        filled = self.width * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def check_launch(tensor_parallel: int, num_pipeline_ranks: int) -> int:
    """This process's rank where the model is cut (torchrun's RANK), 0 where it is not; a launch that
    does not match the options is said at once."""
    import os

    parallel_size = tensor_parallel * num_pipeline_ranks
    if parallel_size == 1:
        return 0
    if tensor_parallel > 1 and num_pipeline_ranks > 1:  # said before "launch with torchrun", which would only lead here
        raise MixtralInferError("use either --tensor_parallel or --num_pipeline_ranks, not both")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != parallel_size:
        raise MixtralInferError(
            f"--tensor_parallel {tensor_parallel} --num_pipeline_ranks {num_pipeline_ranks} needs {parallel_size} "
            f"processes; this is {world_size}: launch with torchrun --nproc-per-node {parallel_size} main.py ..."
        )
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:  # WORLD_SIZE alone, left in the environment: torch's rendezvous error was a traceback
        raise MixtralInferError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} not: "
                                f"launch with torchrun --nproc-per-node {parallel_size} main.py ...")  # fmt: skip
    return int(os.environ["RANK"])


def join_process_group(tensor_parallel: int, num_pipeline_ranks: int, device: Optional[str], timeout_s: Optional[float] = None):
    """(Parallel, device) for this process; joins the torchrun group when the model is cut, its
    collectives timing out after ``timeout_s`` (torch's default without)."""
    import datetime
    import os

    import torch

    from mixtral_infer.model.parallel import Parallel

    if tensor_parallel * num_pipeline_ranks == 1:
        return Parallel(), parse_device(device)
    check_launch(tensor_parallel, num_pipeline_ranks)
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group("nccl" if use_cuda else "gloo", **timeout)
    parallel = Parallel(tensor_parallel=tensor_parallel, num_pipeline_ranks=num_pipeline_ranks, rank=dist.get_rank())
    return parallel, torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")


def is_main_process() -> bool:
    if "torch" not in sys.modules:
        return True  # nothing was loaded, so no process group was joined
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def model_folder(model_path: Optional[str]) -> Path:
    """The folder of MODEL_PATH; a missing one is said at once, with the names it may have meant
    (shipped models, folders beside it) and, for text with spaces, that a prompt is given with --prompt."""
    if model_path is None:
        return DEFAULT_MODEL
    folder = resolve_model_folder(str(model_path))
    if not folder.exists():
        name = str(model_path)
        near = Path(name).parent if Path(name).parent.is_dir() else Path(".")
        candidates = list(shipped_models()) + [str(near / p.name) if str(near) != "." else p.name
                                               for p in near.iterdir() if p.is_dir()]  # fmt: skip
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        hint = f": did you mean {close[0]}?" if close else ""
        if " " in name.strip():
            hint += f" (to give a prompt, write --prompt {json.dumps(name)})"
        raise MixtralInferError(f"{name}: model folder not found{hint}")
    return folder


def load(
    model_path: Optional[str],
    max_batch_size: int,
    device: Optional[str],
    dtype: Optional[str],
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    max_tokens: int = 0,
    quantize: Optional[str] = None,
    decode: str = "auto",
    lora: Optional[str] = None,
    lora_scale: float = 1.0,
    served_adapters: Sequence[Tuple[str, str]] = (),
    collective_timeout: Optional[float] = None,
):
    """(model, tokenizer) from a model folder or a shipped model's name; tiny-mixtral when none is given.
    ``served_adapters``: (name, path) of LoRA adapters kept apart beside the weights (``serve --lora NAME=PATH``).

    Before any weight is read: the tokenizer must be there, and a model without a
    sliding window must have room for a cache of ``max_tokens`` new tokens. With
    ``decode="compiled"`` a bfloat16 model on CPU keeps its weights plain, which compiled
    decoding reads faster than oneDNN's layout (``fast.cpu_reductions``; docs/performance.md).
    """
    from mixtral_infer.checkpoint.loading import TOKENIZER_FILE, default_dtype, load_model, open_checkpoint
    from mixtral_infer.generation.settings import check_new_cache, describe_windows
    from mixtral_infer.quant.scheme import QuantScheme
    from mixtral_infer.tokenizer import Tokenizer, find_tokenizer

    folder = model_folder(model_path)
    if int(tensor_parallel) * int(num_pipeline_ranks) > 1 and decode in ("static", "compiled"):  # said after loading
        raise MixtralInferError(f"--decode {decode} needs the whole model in one process; use --decode eager (or auto)")
    parallel, torch_device = join_process_group(int(tensor_parallel), int(num_pipeline_ranks), device, collective_timeout)
    torch_dtype = parse_dtype(dtype)
    tokenizer_path = find_tokenizer(folder)
    if folder.is_dir() and tokenizer_path is None:
        raise MixtralInferError(f"{folder / TOKENIZER_FILE}: file not found (the command line needs the model's tokenizer)")
    checkpoint = open_checkpoint(folder)  # the configuration and the file headers only
    tokenizer = Tokenizer(tokenizer_path)  # read (and refused) before the weights
    args = checkpoint.args
    torch_dtype = torch_dtype or default_dtype(checkpoint, torch_device, QuantScheme.parse(quantize))
    check_new_cache(args, max_batch_size, int(max_tokens) + 1, int(max_tokens), torch_dtype, torch_device, parallel)
    start = time.perf_counter()
    model = load_model(
        folder,
        max_batch_size=max_batch_size,
        device=torch_device,
        dtype=torch_dtype,
        progress=ProgressBar("loading") if is_main_process() else None,
        parallel=parallel,
        quantize=quantize,
        pack="columns" if decode == "compiled" else True,  # compiled: plain weights, long rows in blocks
        lora=lora,
        lora_scale=float(lora_scale),
    )
    del checkpoint  # a GGUF file's reader, and the file mapped with it, go now (gguf_reader)
    if served_adapters:
        from mixtral_infer.checkpoint.lora import attach_served
        from mixtral_infer.formats.adapters import adapter_bytes

        attach_served(model, served_adapters, float(lora_scale))
        print(f"kept apart: LoRA adapters {', '.join(name for name, _ in served_adapters)} "
              f"({adapter_bytes(model) / 2**20:.1f} MiB beside the weights)", file=sys.stderr)  # fmt: skip
    if torch_device.type == "cpu":
        from mixtral_infer.memory import keep_freed_memory

        keep_freed_memory()  # this process's prompts reuse freed heap pages (see --help)
    from mixtral_infer.formats.packing import blocked_numel
    from mixtral_infer.formats.packing import packed_numel
    from mixtral_infer.quant.model import model_scheme, quantized_numel

    held_apart = quantized_numel(model) + packed_numel(model) + blocked_numel(model)  # not in model.parameters()
    n_params = sum(p.numel() for p in model.parameters()) + held_apart
    scheme = model_scheme(model)
    # A model whose layers differ in attention says how (its cache is each layer's own size).
    attention = f", {describe_windows(model.args)}" if isinstance(model.args.sliding_window, list) else ""
    print(
        f"rank {parallel.rank}: " if parallel.world_size > 1 else "",
        f"loaded {folder}{f' with LoRA {lora} merged' if lora else ''} ({n_params / 1e6:.1f}M parameters, {model.dtype}{', weights ' + scheme.label if scheme else ''}, "
        f"{model.device}{attention}) "
        f"in {time.perf_counter() - start:.2f}s",
        sep="",
        file=sys.stderr,
    )
    return model, tokenizer


def prompt_list(prompt: object, prompt_file: object = None) -> List[str]:
    """The prompts ``--prompt`` gave (``main`` hands them over as one list), then those of
    ``--prompt-file`` (one a line, empty lines skipped; ``-`` reads stdin), else the built-in ones."""
    from_file: List[str] = []
    if prompt_file is not None:
        if not isinstance(prompt_file, str) or not prompt_file:
            raise GenerationError(f"--prompt-file {prompt_file!r}: give a file's path, or - for standard input")
        try:
            text = sys.stdin.read() if prompt_file == "-" else Path(prompt_file).read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise GenerationError(f"--prompt-file {prompt_file}: cannot read it ({error.strerror})") from None
        from_file = [line for line in text.splitlines() if line.strip()]
        if not from_file:
            raise GenerationError(f"--prompt-file {prompt_file}: holds no prompt (one per line)")
    if prompt is None or (isinstance(prompt, (list, tuple)) and not prompt):
        return from_file or list(DEMO_PROMPTS)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise GenerationError(f"--prompt {prompt!r}: give the text of a prompt, e.g. --prompt 'In the beginning'")
    return list(prompts) + from_file


def demo(
    model_path: str = None,
    prompt: str = (),
    max_tokens: int = 60,
    temperature: float = 0.7,
    top_p: float = 0.9,
    top_k: int = None,
    chunk_size: int = None,
    seed: int = 0,
    device: str = None,
    dtype: str = None,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    decode: str = "auto",
    quantize: str = None,
    prompt_file: str = None,
    json: bool = False,
    draft_model: str = None,
    speculative_ngram: bool = False,
    speculative_tokens: int = None,
    lora: str = None,
    lora_scale: float = 1.0,
) -> None:
    """Complete prompts in one batch and print each with its continuation.

    Prints each prompt and its continuation on stdout, then "N tokens in S s" on stderr.
    Sampled with a fixed seed, so the output is the same every run; --temperature 0 is greedy.

    Args:
        model_path: MODEL_PATH, also given as the first argument: {MODEL_PATH}.
        prompt: a prompt to complete; repeat for several (--prompt "In the beginning" --prompt "Blessed are"). Without it: three built-in prompts of different lengths.
        max_tokens: new tokens per prompt at most (fewer when the model ends the text).
        temperature: sampling temperature; 0 is greedy.
        top_p: sample from the smallest set of tokens whose probability reaches top_p, in (0, 1].
        top_k: sample from the top_k most likely tokens only; default: all.
        chunk_size: prompt tokens of each prompt per forward pass; default 2048 shared by the batch. Any value gives the same text.
        seed: random seed, an integer in [0, 2^63); the same seed gives the same text.
        device: cpu, cuda, cuda:N or mps; default cuda when available, else cpu.
        dtype: float32, bfloat16 or float16; default the checkpoint's own (float32 on a CPU without native arithmetic in it).
        tensor_parallel: under torchrun, cut each layer's heads, hidden units or experts across N processes.
        num_pipeline_ranks: under torchrun, give each of N processes a contiguous slice of the layers.
        decode: how tokens after the prompt are produced, alike in result (in 16-bit dtypes compiled code rounds otherwise, so texts may part after some tokens): auto (compiled on cuda; on cpu eager while the compiled step is built in the background, then compiled, where AOTInductor can build it: not for weights packed for oneDNN, the bfloat16 default), eager (one forward per step, the reference), static (the fixed-shape step), compiled (that step compiled: by torch.compile, as a CUDA graph on cuda, by AOTInductor on cpu; on cpu a bfloat16 model then keeps its weights plain, which compiled code reads faster).
        quantize: int8, int4, int4-128 or nf4 (4-bit NormalFloat, fastest on AVX512-BF16 CPUs): weight-only quantization while loading; w8a8: int8 weights, and int8 activations on CPU (faster); computes in bfloat16 unless --dtype says otherwise.
        prompt_file: read prompts from this file, one a line (after any --prompt); - reads standard input.
        json: print one JSON object a line per completion (prompt, text, tokens, finish_reason, seconds, tokens_per_second) instead of the text.
        draft_model: speculative decoding with this smaller model of the same tokenizer (a folder or a shipped name: tiny-mistral drafts for tiny-mixtral): it guesses tokens ahead, the model checks them in one pass; the same text (greedy) or the same distribution (sampled), faster where guesses are right.
        speculative_ngram: speculative decoding by prompt lookup: the guesses are what followed the last tokens earlier in the prompt or answer (no second model); pays where the answer copies from the prompt.
        speculative_tokens: guesses checked per step at most, 1 to 64 (default 4).
        lora: a LoRA adapter merged into the weights as they load: a PEFT folder (adapter_config.json + adapter_model.safetensors) or mistral-inference's lora.safetensors.
        lora_scale: multiplies the adapter's own scale (default 1.0, as trained; 0 leaves the base model).
    """
    check_decode(decode)
    check_quantize(quantize)
    check_lora(lora, lora_scale)
    params = check_options(max_tokens, temperature, top_p, top_k, chunk_size, seed, device, dtype, tensor_parallel, num_pipeline_ranks)
    if not isinstance(json, bool):
        raise UsageError(f"--json takes no value (got {json!r})")
    check_speculative_options(draft_model, speculative_ngram, speculative_tokens, tensor_parallel, num_pipeline_ranks)
    prompts = prompt_list(prompt, prompt_file)
    from mixtral_infer.steps.decode_loop import compile_seconds
    from mixtral_infer.generation.generate import generate

    model, tokenizer = load(
        model_path, len(prompts), device, dtype, tensor_parallel, num_pipeline_ranks, max_tokens, quantize, decode, lora, lora_scale
    )
    draft = load_draft(draft_model, speculative_ngram, tokenizer, len(prompts), device, dtype, max_tokens)
    encoded = [tokenizer.encode(text, bos=True) for text in prompts]
    start = time.perf_counter()
    from mixtral_infer.generation.speculative import check_speculation

    speculation = check_speculation(draft, speculative_tokens)
    generated, _ = generate(
        encoded, model, params, chunk_size=chunk_size, eos_id=tokenizer.eos_id, prompt_logprobs=False, decode=decode,
        draft=speculation,
    )  # fmt: skip
    compiling = compile_seconds(model)  # the step was built in this run: its time is not the tokens'
    elapsed = time.perf_counter() - start - compiling
    if not is_main_process():
        return
    for text, tokens in zip(prompts, generated):
        if json:  # the parameter: the module is json_module here
            reason = "length" if len(tokens) == max_tokens else "stop"
            record = {"prompt": text, "text": tokenizer.decode_continuation(tokens), "tokens": len(tokens), "finish_reason": reason,
                      "seconds": round(elapsed, 4), "tokens_per_second": round(sum(map(len, generated)) / max(elapsed, 1e-9), 2)}  # fmt: skip
            print(json_module.dumps(record, ensure_ascii=False))
            continue
        print(f"{text}{tokenizer.decode_continuation(tokens)}")
        print("-" * 40)
    n_tokens = sum(len(t) for t in generated)
    before = f", after {compiling:.1f}s compiling the decode step (once)" if compiling else ""
    rate = n_tokens / max(elapsed, 1e-9)
    gained = f"; {speculation.stats.line()}" if speculation is not None else ""
    print(f"{n_tokens} tokens in {elapsed:.2f}s ({rate:.1f} tokens/s){before}{gained}", file=sys.stderr)


def interactive(
    model_path: str = None,
    instruct: bool = False,
    max_tokens: int = 100,
    temperature: float = 0.7,
    top_p: float = 0.9,
    top_k: int = None,
    chunk_size: int = None,
    seed: int = None,
    device: str = None,
    dtype: str = None,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    decode: str = "auto",
    quantize: str = None,
    system: str = None,
    draft_model: str = None,
    speculative_ngram: bool = False,
    speculative_tokens: int = None,
    lora: str = None,
    lora_scale: float = 1.0,
) -> None:
    """A prompt loop that streams each answer.

    Each line read is a prompt; its answer streams to stdout, then a line of statistics
    (tokens, tokens/s, time to the first token; a mark when max_tokens cut it) goes to stderr.
    On a terminal: a "> " prompt, line editing and history (up arrow); piped input gives only
    the answers on stdout, one per line. /reset starts a new conversation; /quit, end of input
    (Ctrl-D) or Ctrl-C twice at the prompt leaves; Ctrl-C during an answer stops that answer.

    Args:
        model_path: MODEL_PATH, also given as the first argument: {MODEL_PATH}.
        instruct: wrap each turn in [INST] ... [/INST] and keep the conversation (later turns see earlier ones). For instruction-tuned models; the shipped ones are not.
        system: a system prompt for the conversation (implies --instruct), put before the first turn.
        max_tokens: new tokens per answer at most.
        temperature: sampling temperature; 0 is greedy.
        top_p: sample from the smallest set of tokens whose probability reaches top_p, in (0, 1].
        top_k: sample from the top_k most likely tokens only; default: all.
        chunk_size: prompt tokens per forward pass; default 2048. Any value gives the same text.
        seed: random seed, an integer in [0, 2^63); default: a different answer every run.
        device: cpu, cuda, cuda:N or mps; default cuda when available, else cpu.
        dtype: float32, bfloat16 or float16; default the checkpoint's own (float32 on a CPU without native arithmetic in it).
        tensor_parallel: under torchrun, cut each layer across N processes; rank 0 reads the input and shares each line.
        num_pipeline_ranks: under torchrun, give each of N processes a contiguous slice of the layers.
        decode: how tokens after the prompt are produced, alike in result (in 16-bit dtypes compiled code rounds otherwise, so texts may part after some tokens): auto (compiled on cuda; on cpu eager while the compiled step is built in the background, then compiled, where AOTInductor can build it: not for weights packed for oneDNN, the bfloat16 default), eager, static or compiled (on cpu a bfloat16 model then keeps its weights plain, which compiled code reads faster).
        quantize: int8, int4, int4-128 or nf4 (4-bit NormalFloat, fastest on AVX512-BF16 CPUs): weight-only quantization while loading; w8a8: int8 weights, and int8 activations on CPU (faster); computes in bfloat16 unless --dtype says otherwise.
        draft_model: speculative decoding with this smaller model of the same tokenizer (a folder or a shipped name: tiny-mistral drafts for tiny-mixtral): it guesses tokens ahead, the model checks them in one pass; the same text (greedy) or the same distribution (sampled), faster where guesses are right.
        speculative_ngram: speculative decoding by prompt lookup: the guesses are what followed the last tokens earlier in the prompt or answer (no second model); pays where the answer copies from the prompt.
        speculative_tokens: guesses checked per step at most, 1 to 64 (default 4).
        lora: a LoRA adapter merged into the weights as they load: a PEFT folder (adapter_config.json + adapter_model.safetensors) or mistral-inference's lora.safetensors.
        lora_scale: multiplies the adapter's own scale (default 1.0, as trained; 0 leaves the base model).
    """
    check_decode(decode)
    check_quantize(quantize)
    check_lora(lora, lora_scale)
    if not isinstance(instruct, bool):
        raise UsageError(f"--instruct takes no value (got {instruct!r}): write --instruct or --noinstruct")
    if system is not None:
        if not isinstance(system, str) or not system.strip():
            raise GenerationError(f"--system {system!r}: give the system prompt's text")
        instruct = True
    params = check_options(max_tokens, temperature, top_p, top_k, chunk_size, seed, device, dtype, tensor_parallel, num_pipeline_ranks)
    check_speculative_options(draft_model, speculative_ngram, speculative_tokens, tensor_parallel, num_pipeline_ranks)
    terminal = sys.stdin.isatty()
    if instruct and is_shipped(model_folder(model_path)):
        print(
            f"note: {model_folder(model_path).name} is not instruction-tuned (it continues Bible text); with --instruct it "
            "sees [INST] ... [/INST] it was never trained on. Without --instruct each line is a text to continue.",
            file=sys.stderr,
        )
    from mixtral_infer.generation.chat import Conversation

    model, tokenizer = load(
        model_path, 1, device, dtype, tensor_parallel, num_pipeline_ranks, max_tokens, quantize, decode, lora, lora_scale
    )
    main_process = is_main_process()
    draft = load_draft(draft_model, speculative_ngram, tokenizer, 1, device, dtype, max_tokens)
    conversation = Conversation(
        model, tokenizer, params, instruct=instruct, chunk_size=chunk_size, decode=decode, system=system,
        draft=draft, speculative_tokens=speculative_tokens,
    )  # fmt: skip
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # undecodable bytes become U+FFFD, not a crash
    if main_process and terminal:
        use_readline()
        print("type a prompt; /reset starts a new conversation, /quit or Ctrl-D leaves", file=sys.stderr)
    while True:
        line = read_line("> " if terminal else "") if main_process else None
        line = _share_line(line)
        if line is None:
            return
        if not line.strip():  # an empty or blank line is no prompt: skipped, as a shell skips it
            continue
        if line.strip().startswith("/"):  # "  /quit" too
            command = line.strip()
            if command == "/quit":
                return
            if command == "/reset":
                conversation.reset()
                message = "(new conversation)"
            else:
                message = f"unknown command {command}: use /reset or /quit"
            if main_process:
                print(message, file=sys.stderr)
            continue
        emit = (lambda piece: print(piece, end="", flush=True)) if main_process else (lambda piece: None)
        try:
            reply = conversation.reply(line, emit=emit)
            status = f"[{reply.stats()}" + (f"; cut at --max-tokens {max_tokens}]" if reply.hit_max_tokens else "]")
        except KeyboardInterrupt:
            status = "[stopped by Ctrl-C]"
        if main_process:
            print(flush=True)
            print(status, file=sys.stderr, flush=True)


def use_readline() -> None:
    """Line editing and history (up arrow) for ``input()``, where Python has readline."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:  # Windows without pyreadline
        pass


def read_line(prompt: str) -> Optional[str]:
    """The next input line; None at end of input or at a second Ctrl-C in a row.

    Ctrl-C at the prompt drops the line being typed and says how to leave, like a shell.
    """
    interrupted = False
    while True:
        try:
            return input(prompt).removesuffix("\r")  # a line of a Windows file (CRLF): its text alone
        except EOFError:
            if prompt:
                print(file=sys.stderr)
            return None
        except KeyboardInterrupt:
            if interrupted:
                print(file=sys.stderr)
                return None
            interrupted = True
            print("\n(Ctrl-C: press it again, type /quit or press Ctrl-D to leave)", file=sys.stderr, flush=True)


def _share_line(line: Optional[str]) -> Optional[str]:
    """Rank 0's line, on every rank of a process group."""
    if "torch" not in sys.modules:
        return line
    import torch.distributed as dist

    if not dist.is_initialized():
        return line
    shared = [line]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def convert(src: str, dst: str, to: str = None, dtype: str = None, max_shard_size: str = "5GB", quantize: str = None,
            *, lora: str = None, lora_scale: float = 1.0) -> None:  # fmt: skip  (options only: a 7th argument is a mistake)
    """Write the model folder SRC to the new folder DST, in the other layout.

    DST must not exist; it appears only once complete (written as a hidden .DST.partial-PID first).

    Args:
        src: a model folder (Mistral or Hugging Face layout) or a shipped model's name.
        dst: the folder to write; must not exist.
        to: mistral (params.json + consolidated.safetensors) or hf (config.json + sharded model.safetensors, with the tokenizer files transformers reads); default: the layout SRC is not in.
        dtype: float32, bfloat16 or float16; default: as stored.
        max_shard_size: largest shard of a Hugging Face folder, e.g. 5GB or 500MB.
        quantize: int8, w8a8, int4, int4-128 or nf4: write a quantized Mistral folder (integers + scales) that loads without quantizing again.
        lora: a LoRA adapter merged into the weights written (then quantized, with --quantize): a PEFT folder or mistral-inference's lora.safetensors.
        lora_scale: multiplies the adapter's own scale (default 1.0, as trained).
    """
    check_quantize(quantize)
    check_lora(lora, lora_scale)
    torch_dtype = parse_dtype(dtype)  # both refused before the conversion code (and torch) is imported
    from mixtral_infer.checkpoint.convert import convert as convert_folder

    start = time.perf_counter()
    written = convert_folder(
        str(src), str(dst), to=to, dtype=torch_dtype, max_shard_size=str(max_shard_size),
        notify=lambda message: print(message, file=sys.stderr), quantize=quantize, progress=ProgressBar("converting"),
        lora=lora, lora_scale=float(lora_scale),
    )
    print(f"wrote {written} in {time.perf_counter() - start:.2f}s", file=sys.stderr)


def perplexity(
    model_path: str = None,
    text: str = None,
    context: int = None,
    chunk_size: int = None,
    device: str = None,
    dtype: str = None,
    quantize: str = None,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    lora: str = None,
    lora_scale: float = 1.0,
) -> None:
    """Perplexity of a text file under the model: how a quantization or a dtype changes its predictions.

    Prints "perplexity P over N tokens (...)" on stdout and the time on stderr. Every token of the
    text is predicted once, from the tokens before it in its segment (each segment starts with BOS).

    Args:
        model_path: MODEL_PATH, also given as the first argument: {MODEL_PATH}.
        text: the text file to score (UTF-8); /dev/stdin for standard input.
        context: tokens a segment at most, BOS included; default: the whole text as one segment for a model with a sliding window (its cache keeps the window whatever the length), 4096 for a model without.
        chunk_size: tokens of each segment per forward pass; default 2048 shared by the segments read at once. Any value gives the same perplexity.
        device: cpu, cuda, cuda:N or mps; default cuda when available, else cpu.
        dtype: float32, bfloat16 or float16; default the checkpoint's own (float32 on a CPU without native arithmetic in it).
        quantize: int8, w8a8, int4, int4-128 or nf4: quantize the weights while loading, to measure what it costs.
        tensor_parallel: under torchrun, cut each layer's heads, hidden units or experts across N processes.
        num_pipeline_ranks: under torchrun, give each of N processes a contiguous slice of the layers.
        lora: a LoRA adapter merged into the weights as they load: a PEFT folder (adapter_config.json + adapter_model.safetensors) or mistral-inference's lora.safetensors.
        lora_scale: multiplies the adapter's own scale (default 1.0, as trained; 0 leaves the base model).
    """
    check_quantize(quantize)
    check_lora(lora, lora_scale)
    check_options(0, 0.0, 1.0, None, chunk_size, None, device, dtype, tensor_parallel, num_pipeline_ranks)
    from mixtral_infer.generation.settings import check_context

    context = check_context(context, "--context")
    # Under torchrun rank 0 reads the text and shares it once the group is joined: a pipe (/dev/stdin)
    # read by every rank gave each a part, and collectives of different sizes.
    reads = int(os.environ.get("RANK", "0")) == 0
    words = read_text(text) if reads else check_text_option(text)  # None until shared
    if reads and not words:  # said before the model loads (perplexity() says it of a text that encodes to nothing)
        raise GenerationError(f"no tokens to score: {text} is empty")
    from mixtral_infer.checkpoint.loading import open_checkpoint
    from mixtral_infer.generation.generate import PREFILL_TOKENS
    from mixtral_infer.generation.perplexity import DEFAULT_CONTEXT
    from mixtral_infer.generation.perplexity import perplexity as text_perplexity

    args = open_checkpoint(model_folder(model_path)).args  # the configuration only: is there a window?
    if context is None and args.full_attention:
        context = DEFAULT_CONTEXT
    batch = 1 if context is None else max(1, min(64, PREFILL_TOKENS // context))  # segments read at once
    model, tokenizer = load(model_path, batch, device, dtype, tensor_parallel, num_pipeline_ranks, 0, quantize,
                            lora=lora, lora_scale=lora_scale)  # fmt: skip
    words = _share_line(words)
    ids = tokenizer.encode(words, bos=False)
    progress = ProgressBar("scoring")
    start = time.perf_counter()
    result = text_perplexity(
        model, ids, tokenizer.bos_id, context=context, chunk_size=chunk_size,
        on_segments=progress if is_main_process() else None,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    if is_main_process():
        print(result)
        print(f"scored in {elapsed:.2f}s ({result.tokens / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)


def check_text_option(path: object) -> None:
    if path is None or isinstance(path, bool):  # fire reads `--text` alone, or `--text -`, as True
        raise UsageError(
            "--text FILE is required: the file whose perplexity to measure (/dev/stdin for standard input)"
        )


def read_text(path: object) -> str:
    """The text of the file ``--text`` names (/dev/stdin for standard input), which must be UTF-8: the
    perplexity of a text read with its undecodable bytes as U+FFFD would measure another text."""
    check_text_option(path)
    try:
        data = Path(str(path)).read_bytes()
    except OSError as error:
        raise GenerationError(f"--text {path}: cannot read it ({error.strerror or error})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise GenerationError(
            f"--text {path}: not UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "convert it to UTF-8 first (iconv -t utf-8)"
        ) from None


def models() -> None:
    """List the models shipped with the package; their names work wherever MODEL_PATH is asked for."""
    from mixtral_infer.checkpoint.loading import read_params

    for name, folder in shipped_models().items():
        args = read_params(folder)
        kind = f"{args.moe.num_experts} experts top-{args.moe.num_experts_per_tok}" if args.moe is not None else "dense"
        default = " (default)" if name == DEFAULT_MODEL_NAME else ""
        print(f"{name}{default}: dim {args.dim}, {args.n_layers} layers, {kind}, window {args.sliding_window}  {folder}")


def serve(
    model_path: str = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_rows: int = None,
    memory_fraction: float = None,
    max_queue: int = 256,
    prefill_tokens: int = 512,
    max_model_len: int = None,
    device: str = None,
    dtype: str = None,
    decode: str = "auto",
    quantize: str = None,
    served_model_name: str = None,
    shutdown_timeout: float = 30.0,
    admit_every: int = None,
    pin_cpus: bool = False,
    no_prefix_reuse: bool = False,
    reuse_slack: int = 256,
    draft_model: str = None,
    speculative_ngram: bool = False,
    speculative_tokens: int = None,
    lora: str = None,
    lora_scale: float = 1.0,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    collective_timeout: float = 120.0,
) -> None:
    """An OpenAI-compatible HTTP server with continuous batching (needs the serve extra).

    POST /v1/completions and /v1/chat/completions (stream: true for server-sent events),
    GET /v1/models, /health, /metrics (Prometheus). SIGTERM stops taking requests and lets
    running ones finish.

    Args:
        model_path: MODEL_PATH, also given as the first argument: {MODEL_PATH}.
        host: the address to listen on; 0.0.0.0 listens on every interface.
        port: the TCP port to listen on.
        max_rows: sequences decoded at once (cache rows); default: from --memory-fraction, at most 64.
        memory_fraction: share of the device's memory (RAM on cpu) for weights, one prefill step and the cache rows; default 0.9.
        max_queue: requests that may wait for a row; one more gets 429 with Retry-After.
        prefill_tokens: prompt tokens read per engine step, shared by the waiting prompts.
        max_model_len: tokens per sequence (prompt + answer); a request asking for more gets a 400. Required for a model without a sliding window (its rows hold that many); with a window, default the longest sequence the model's params.json or config.json declares, else 32768.
        device: cpu, cuda, cuda:N or mps; default cuda when available, else cpu.
        dtype: float32, bfloat16 or float16; default the checkpoint's own (float32 on a CPU without native arithmetic in it).
        decode: how steps where every row decodes run, alike in result (in 16-bit dtypes compiled code rounds otherwise, so texts may part after some tokens): auto (the default: the static step compiled before serving, and on cpu chosen per step against the eager pass; uncompiled if compiling fails), eager, static or compiled.
        quantize: int8, int4, int4-128 or nf4 (4-bit NormalFloat, fastest on AVX512-BF16 CPUs): weight-only quantization while loading; w8a8: int8 weights, and int8 activations on CPU (faster); computes in bfloat16 unless --dtype says otherwise.
        served_model_name: the model name clients send and /v1/models lists; default: the folder's name.
        shutdown_timeout: seconds running requests may take to finish after SIGTERM before they are cancelled.
        admit_every: waiting prompts join the running batch every K steps (1: every step, the lowest time to first token); default 1, or 6 where decode steps run compiled and the steps that read prompts do not (auto and compiled on cpu).
        pin_cpus: run the engine's process on all but one of the CPUs this server may use, and the server's own process (HTTP, JSON) on that one, so that neither interrupts the other.
        no_prefix_reuse: read every prompt whole; by default a request that continues what a cache row holds (a chat's next turn, a shared system prompt) starts after it.
        reuse_slack: positions each windowed layer of a row keeps after its window moves past them (counted in the rows' memory), so that a regenerated answer or an edited last message of up to that many tokens steps back instead of reading the whole conversation again; 0 turns it off.
        draft_model: speculative decoding with this smaller model of the same tokenizer, loaded beside the model: at steps where every row decodes it guesses tokens ahead and the model checks them in one pass, where that gives more tokens a second (measured as the server runs, per batch size); the same text as without. A request turns it off with "speculative": false.
        speculative_ngram: speculative decoding by prompt lookup (no second model): guesses are what followed the last tokens earlier in the request's text.
        speculative_tokens: guesses checked per step at most, 1 to 64 (default 4); each row keeps that many positions more (counted in its memory), to step back over rejected guesses.
        lora: PATH: a LoRA adapter merged into the weights as they load, for every request; NAME=PATH[,NAME=PATH...]: adapters kept apart beside the weights, served at once: a request names one as its "model" (/v1/models lists them), and rows of different adapters decode in one batch.
        lora_scale: multiplies the adapters' own scale (default 1.0, as trained).
        tensor_parallel: under torchrun (torchrun --nproc-per-node N main.py serve ...), cut each layer's heads, hidden units or experts across N processes; rank 0 serves HTTP and schedules, every rank runs each step on its share.
        num_pipeline_ranks: under torchrun, cut the layers into N consecutive stages, one a process.
        collective_timeout: seconds a process of a cut model waits on the others before it says which one is gone and every process stops (also the bound on how far apart the processes may finish loading).
    """
    check_decode(decode)
    check_quantize(quantize)
    check_options(16, 0.0, 1.0, None, None, None, device, dtype, tensor_parallel, num_pipeline_ranks)
    if int(tensor_parallel) * int(num_pipeline_ranks) > 1 and decode in ("static", "compiled"):
        raise GenerationError(f"--decode {decode} needs the whole model in one process; a cut model is served with --decode eager (or auto)")
    if lora is not None and "=" in str(lora) and int(tensor_parallel) * int(num_pipeline_ranks) > 1:
        raise GenerationError("--lora NAME=PATH (adapters kept apart) needs the whole model in one process; under torchrun "
                              "merge one adapter with --lora PATH")  # fmt: skip
    named = check_lora(lora, lora_scale, named=True)
    from mixtral_infer.serve.options import check_serve_options

    check_serve_options(port, max_rows, memory_fraction, max_queue, prefill_tokens, max_model_len, shutdown_timeout, admit_every, reuse_slack)
    check_speculative_options(draft_model, speculative_ngram, speculative_tokens, tensor_parallel, num_pipeline_ranks)
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) or collective_timeout <= 0:
        raise GenerationError(f"--collective-timeout {collective_timeout!r} must be a number of seconds > 0")
    rank = check_launch(int(tensor_parallel), int(num_pipeline_ranks))
    from mixtral_infer.checkpoint.loading import declared_max_len, open_checkpoint
    from mixtral_infer.serve.server import DEFAULT_MAX_MODEL_LEN, follow_server, run_server
    from mixtral_infer.tokenizer import Tokenizer

    folder = model_folder(model_path)
    checkpoint = open_checkpoint(folder)  # the configuration and file headers: a bad folder is said before the engine starts
    if lora is not None:  # the adapters' names and shapes against the model's, before the engine starts
        from mixtral_infer.checkpoint.lora import open_adapter, open_served

        for _, path in named:
            open_served(path, checkpoint.args, float(lora_scale))
        if not named:
            open_adapter(lora, checkpoint.args, float(lora_scale))
    if max_model_len is None and checkpoint.args.full_attention:
        what = "no sliding window" if checkpoint.args.sliding_window is None else "full-attention layers"
        raise GenerationError(f"this model has {what}: give --max-model-len (tokens per sequence) to size its rows")
    if max_model_len is None:  # a bound on each request (a row holds the window, whatever the length)
        max_model_len = declared_max_len(checkpoint) or DEFAULT_MAX_MODEL_LEN
    model_load = functools.partial(
        load, model_path, 1, device, dtype, int(tensor_parallel), int(num_pipeline_ranks), quantize=quantize,
        lora=None if named else lora, lora_scale=lora_scale, served_adapters=named, collective_timeout=float(collective_timeout),
    )  # fmt: skip
    settings = dict(
        prefill_tokens=int(prefill_tokens), max_model_len=max_model_len, decode=decode,
        admit_every=None if admit_every is None else int(admit_every), prefix_reuse=not no_prefix_reuse, reuse_slack=int(reuse_slack),
    )  # fmt: skip
    if rank != 0:  # a share of the model, no HTTP: rank 0's engine sends each step (serve.step_group)
        follow_server(model_load, collective_timeout=float(collective_timeout), **settings)
        return
    tokenizer = Tokenizer.from_folder(folder)  # this process turns requests into tokens; the engine's loads the model
    given = str(model_path) if model_path is not None else DEFAULT_MODEL_NAME
    name = served_model_name or (given if is_hub_name(given) and not Path(given).exists() else resolve_model_folder(given).name)
    if any(adapter == str(name) for adapter, _ in named):
        raise UsageError(f"--lora: the adapter name {name!r} is the model's own (--served-model-name): name it otherwise")
    run_server(
        model_load, tokenizer, model_name=str(name), adapters=[adapter for adapter, _ in named], host=str(host),
        port=int(port), max_rows=max_rows, memory_fraction=memory_fraction, max_queue=int(max_queue),
        shutdown_timeout=float(shutdown_timeout), pin_cpus=bool(pin_cpus), speculative_ngram=speculative_ngram,
        speculative_tokens=None if speculative_tokens is None else int(speculative_tokens),
        draft_load=None if draft_model is None else functools.partial(load, draft_model, 1, device, dtype),
        collective_timeout=float(collective_timeout) if rank == 0 and int(tensor_parallel) * int(num_pipeline_ranks) > 1 else None,
        **settings,
    )  # fmt: skip


COMMANDS = {
    "demo": demo, "interactive": interactive, "perplexity": perplexity,
    "convert": convert, "models": models, "serve": serve,
}  # fmt: skip
for _command in (demo, interactive, perplexity, serve):
    _command.__doc__ = _command.__doc__.replace("{MODEL_PATH}", MODEL_PATH_HELP)

USAGE = f"""usage: mixtral-infer COMMAND [ARGS] [--OPTIONS]   (also: python main.py ..., python -m mixtral_infer ...)

commands:
  demo [MODEL_PATH] [--prompt TEXT]...     complete prompts in one batch (without --prompt: three built-in ones)
  interactive [MODEL_PATH] [--instruct]    a prompt loop that streams each answer
  perplexity [MODEL_PATH] --text FILE      how well the model predicts a text (e.g. after --quantize)
  convert SRC DST [--to mistral|hf]        write a model folder in the other layout
  models                                   list the shipped models
  serve [MODEL_PATH] [--port 8000]         an OpenAI-compatible HTTP server (the serve extra)

MODEL_PATH: {MODEL_PATH_HELP}.

On CPU the commands that load a model keep freed heap memory in the process, so that each
prompt reuses the pages of the last (glibc's mallopt; mixtral_infer.memory). The Python API's
load_model changes no such setting.
MIXTRAL_INFER_REFERENCE=1 runs the readable reference path everywhere (no fast modules).

mixtral-infer COMMAND --help lists a command's options with their defaults.
mixtral-infer --version prints the version.
"""


def command_help(command: str) -> str:
    """fire's help text of one command (fire itself prints it on stderr, so ``| less`` would show nothing),
    without the ``-h`` fire lists for an option that starts with h (``-h, --host``): ``-h`` is help everywhere."""
    from fire import helptext, trace

    command_trace = trace.FireTrace(COMMANDS, name="mixtral-infer")
    command_trace.AddAccessedProperty(COMMANDS[command], command, [command], None, None)
    text = re.sub(r"(?m)^(\s*)-h, (--\w)", r"\1\2", helptext.HelpText(COMMANDS[command], command_trace))
    # options as the errors and the README write them, --max-model-len (fire takes both spellings)
    return re.sub(r"--(\w+)=", lambda m: f"--{m[1].replace('_', '-')}=", text)


def gather_prompts(argv: List[str]) -> List[str]:
    """``demo``'s repeated ``--prompt TEXT`` as one ``--prompt=[...]`` that fire reads as a list of strings.

    fire keeps only the last of a repeated option and turns ``--prompt 3`` into the number 3;
    a list literal of JSON strings (also Python string literals) reaches ``demo`` as the texts typed.
    """
    if not argv or argv[0] != "demo":
        return argv
    end = argv.index("--") if "--" in argv else len(argv)
    kept, prompts, index = [], [], 1
    while index < end:
        arg = argv[index]
        if arg in ("--prompt", "-p") and index + 1 < end:
            prompts.append(argv[index + 1])
            index += 2
            continue
        if arg.startswith("--prompt="):
            prompts.append(arg.split("=", 1)[1])
        elif arg in ("--prompt-file", "--prompt_file") and index + 1 < end:  # fire would read "-" (stdin) as a flag
            kept.append(f"--prompt_file={json.dumps(argv[index + 1])}")
            index += 1
        else:
            kept.append(arg)
        index += 1
    if not prompts:
        return [argv[0], *kept, *argv[end:]]
    return [argv[0], *kept, f"--prompt={json.dumps(prompts)}", *argv[end:]]


def check_arguments(argv: List[str]) -> None:
    """Refuse unknown options and surplus arguments before fire runs anything.

    fire calls the command with the arguments it recognises and only complains about
    the others after the call returns: ``demo --max_token 5`` would run the whole
    default demo first. The rules are fire's: ``--name value``, ``--name=value``,
    ``--flag`` / ``--noflag`` for booleans, ``-`` and ``_`` alike; ``--`` ends the options. Each
    refusal is a ``UsageError`` (exit 2).
    """
    if not argv or argv[0] not in COMMANDS or any(a in ("-h", "--help") for a in argv):
        return  # fire's own usage message
    command, args = argv[0], list(argv[1:])
    if "--" in args:
        args = args[: args.index("--")]
    parameters = inspect.signature(COMMANDS[command]).parameters
    names = list(parameters)
    given, positional, skip = set(), [], False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if not arg.startswith("-") or re.fullmatch(r"-[\d.].*", arg):
            positional.append(arg)
            continue
        key = arg.lstrip("-").split("=", 1)[0].replace("-", "_")
        is_flag = "=" not in arg and (index + 1 == len(args) or args[index + 1].startswith("--"))
        name = key[2:] if is_flag and key.startswith("no") and key[2:] in names and key not in names else key
        shortcuts = [n for n in names if len(key) == 1 and n.startswith(key)]
        name = shortcuts[0] if len(shortcuts) == 1 else name
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            raise UsageError(
                f"{command}: unknown option {arg.split('=', 1)[0]}; {hint}options: {', '.join('--' + n for n in names)}"
            )
        if name in given:  # fire keeps the last one silently
            raise UsageError(f"{command}: --{name} is given twice; give it once")
        if is_flag and not isinstance(parameters[name].default, bool):  # fire would pass True
            raise UsageError(f"{command}: --{name} needs a value (--{name} VALUE)")
        given.add(name)
        skip = "=" not in arg and not is_flag
    free = [n for n in names if n not in given and parameters[n].kind != inspect.Parameter.KEYWORD_ONLY]  # options only: convert's --lora
    if len(positional) > len(free):
        raise UsageError(f"{command}: unexpected argument {positional[len(free)]!r} (takes {', '.join(free) or 'none'})")
    for value, name in zip(positional, free):
        if isinstance(parameters[name].default, bool):  # fire would read `interactive MODEL x` as --instruct x
            raise UsageError(
                f"{command}: unexpected argument {value!r} (a switch such as --{name} is written as one)"
            )


def main(argv: Optional[List[str]] = None) -> int:
    from mixtral_infer import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--version"], ["-V"]):
        print(f"mixtral-infer {__version__}")
        return 0
    if argv in ([], ["--help"], ["-h"], ["help"]):
        print(USAGE, end="")
        return 0
    if argv[0] in COMMANDS and any(arg in ("-h", "--help") for arg in argv[1:]):
        print(command_help(argv[0]))
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: unknown command {argv[0]!r}: {hint}(commands: {', '.join(COMMANDS)}; --help says more)", file=sys.stderr)
        return USAGE_EXIT
    if "torch" not in sys.modules and not any(isinstance(f, DeferCtrlCWhileTorchImports) for f in sys.meta_path):
        sys.meta_path.insert(0, DeferCtrlCWhileTorchImports())
    try:
        import fire

        argv = gather_prompts(argv)
        check_arguments(argv)
        fire.Fire(COMMANDS, command=argv, name="mixtral-infer")
    except MixtralInferError as error:
        print(f"error: {cli_spelling(str(error))}", file=sys.stderr)
        return USAGE_EXIT if isinstance(error, UsageError) else 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head -1`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit fails no more
        return 141
    finally:
        close_process_group()
    return 0


class DeferCtrlCWhileTorchImports(importlib.abc.MetaPathFinder):
    """Holds Ctrl-C while ``torch`` and ``triton`` are first imported, wherever that happens, then acts on it.

    A KeyboardInterrupt raised inside the Python callbacks torch's (pybind11) or triton's (nanobind)
    C++ runs while it imports ends the process with ``terminate called after throwing ...``, and a
    half-imported module cannot be imported again. triton is imported later, by torch's own lazy
    imports (``torch._dynamo`` asks whether it is there, as xformers' import does). So each import's
    own code runs with SIGINT recorded, not raised (importing takes seconds: Ctrl-C waits that long),
    and a recorded one is raised as the outermost of them returns. Options are still checked before
    torch is imported."""

    NAMES = ("torch", "triton")

    def __init__(self, names=NAMES):
        self.waiting = set(names)
        self.interrupted: list = []
        self.depth = 0  # the held imports running now (triton may be imported within torch's)

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)  # once: the real finders find it (the call below comes back here)
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or threading.current_thread() is not threading.main_thread():
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            previous = signal.signal(signal.SIGINT, lambda *_: self.interrupted.append(True)) if self.depth == 0 else None
            self.depth += 1
            try:
                run(module)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    signal.signal(signal.SIGINT, previous)
            if self.depth == 0 and self.interrupted:
                self.interrupted.clear()
                raise KeyboardInterrupt

        spec.loader.exec_module = exec_module
        return spec


def close_process_group() -> None:
    """End a torch.distributed process group the command joined. Nothing is imported here: after a
    Ctrl-C during ``import torch`` the module is half made, and importing it again would fail."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except (AttributeError, ImportError, RuntimeError):  # a half-imported module: no group was joined
        pass


if __name__ == "__main__":
    sys.exit(main())
