"""GPU benchmark: ours (eager and fast) against transformers (eager and StaticCache + torch.compile).

One command on any CUDA machine, nothing downloaded::

    python bench/bench_gpu.py --out bench/results_gpu.json
    python bench/bench_gpu.py --layers 4 --models mistral-7b   # scaled down

The Mistral-7B and Mixtral-8x7B shapes are built by transformers with random bfloat16 weights
on the GPU (``MistralForCausalLM`` / ``MixtralForCausalLM``, sdpa attention), and the SAME
weights are loaded into ours (``hf_to_published`` + ``build_model``). Mixtral 8x7B (93 GB) does
not fit twice on one GPU: when both copies do not fit, its layers are cut to the largest
count that does (``layers`` in each row says how many ran; ``--layers`` sets it by hand).

Rows, each the median of 3 timed runs after a warm-up (the warm-up of ``ours fast`` and of
``transformers compiled`` includes their compilation, reported as ``compile_s``):

* decode at batch 1, 8, 32: prompts of 128 random tokens, 128 greedy new tokens, only the
  decode loop timed (tokens after the first, over the time from the first token to the last):

  - ``ours eager``: ``generate(..., decode="eager")``;
  - ``ours fast``: ``generate(..., decode="compiled")``, the static step compiled and replayed
    as a CUDA graph;
  - ``transformers eager``: the loop ``model(tokens, past_key_values=...)`` + argmax;
  - ``transformers compiled``: ``model.generate(cache_implementation="static")``, which
    compiles the forward (``torch.compile``, CUDA graphs) for decoding; decode time is the
    time of 128 new tokens minus the time of 1;
  - ``floor``: every weight matrix a decode step reads, read once by ``F.linear`` on one row
    per sequence, all of them captured in one CUDA graph and replayed (Mixtral: attention,
    router, and ``min(E, B * k)`` experts per layer).

* prefill of one prompt of 2048 and 8192 tokens, last logit only (what generation needs):
  ours ``generate.prefill`` (last logits only) at the default chunk, transformers
  ``model(prompt, logits_to_keep=1)``; with the peak GPU memory over what was allocated before.

* quantized decode (``--quantize int8 int4``, default both, or ``int4-128``, ``nf4``, and
  ``int8-gemlite``, ``int4-gemlite``, ``int4-128-gemlite`` through GemLite's kernels; ``--quantize``
  alone for none): the same model's weights quantized (``quant.model.quantize_model``: int8 per
  output row, int4 in groups of 32 or 128, nf4 in groups of 64 through bitsandbytes' CUDA kernel;
  without ``-gemlite``, PyTorch's kernels even where GemLite is installed; ``-gemlite-f32``:
  GemLite's outputs in float32, converted by the compiled step, ``Tuning.gemlite_float32_outputs`` on),
  decode at batch 1 eager and fast, with the greedy agreement of its tokens with the bfloat16 model's
  (``same_tokens``: leading tokens equal). A copy is quantized where one fits beside the
  bfloat16 model; else the model itself, and later schemes are skipped.

  ``--modes compiled`` skips ours' eager rows, bfloat16's too (and the agreement, which needs the
  bfloat16 model's eager tokens). Targets on an H100/H200: Mistral-7B int8 >= 1.6x bfloat16 fast,
  int4 >= 2.2x; Mixtral-8x7B int8 >= 150 tok/s.

``--without-transformers`` builds ours alone from random weights, with every layer (Mixtral
8x7B's 93 GB fit once on a 141 GB GPU, not twice), and skips transformers' rows: for the
full-size quantized rows, as measured on the H200 (``bench/results_gpu_h200_*``)::

    python bench/bench_gpu.py --models mixtral-8x7b --without-transformers --batches --prefill \
        --quantize int8 --modes compiled --repeats 2 --out bench/results_gpu_h200_mixtral_int8.json

``--triton-experts`` runs Mixtral's decode steps with the experts through the two Triton kernels of
``fast/triton_experts.py`` (``Tuning.triton_experts``: each chosen expert read once, dequantized where it
is read; a matrix-vector product per assignment at batch 1 to 3, a grouped product beyond), for
bfloat16 and PyTorch's int8 and int4 layouts (the experts' plain values)::

    python bench/bench_gpu.py --models mixtral-8x7b --without-transformers --batches 1 8 32 \
        --quantize int8 int4 --modes compiled --repeats 2 --triton-experts --out bench/results_gpu_triton.json

``--triton-dense`` sends the quantized products of a few rows (int8, int4) through the same kernels,
each weight read as one expert (``Tuning.triton_dense``): Mistral-7B's batch-1 rows against GemLite's.

``--grouped-experts`` runs Mixtral's decode steps at ``B * k >= E`` (batch 8 and 32) with the experts as
one grouped GEMM per projection (``Tuning.grouped_experts``, off by default until measured): run it
beside a run without to decide the default::

    python bench/bench_gpu.py --models mixtral-8x7b --without-transformers --batches 1 8 32 --prefill \
        --quantize --modes compiled --repeats 2 --grouped-experts --out bench/results_gpu_grouped.json

The JSON is rewritten after every row, so a run cut short keeps its rows.

Greedy tokens of ours and transformers are compared (first difference reported; random
bfloat16 models can part ways on near ties after a while, which is not an error).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixtral_infer import ModelArgs, MoeArgs, Transformer, generate  # noqa: E402
from mixtral_infer.checkpoint.hf_format import hf_to_published  # noqa: E402
from mixtral_infer.checkpoint.loading import build_model  # noqa: E402
from mixtral_infer.formats.modules import tuning_of, use_formats  # noqa: E402
from mixtral_infer.generation.generate import default_chunk_size, prefill  # noqa: E402
from mixtral_infer.model.moe import MoeLayer  # noqa: E402
from mixtral_infer.kernels.moe.gathered import plain_int8  # noqa: E402
from mixtral_infer.kernels.linear import gemlite as gemlite_cuda  # noqa: E402
from mixtral_infer.formats.quantizing import quantize_model  # noqa: E402

SHAPES = {
    "mistral-7b": dict(
        dim=4096, n_layers=32, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, norm_eps=1e-5,
        vocab_size=32000, sliding_window=4096, rope_theta=10000.0,
    ),
    "mixtral-8x7b": dict(
        dim=4096, n_layers=32, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, norm_eps=1e-5,
        vocab_size=32000, sliding_window=None, rope_theta=1e6, moe=MoeArgs(num_experts=8, num_experts_per_tok=2),
    ),
    # A few MB, for a smoke run anywhere (``--models tiny --device cpu``).
    "tiny": dict(
        dim=128, n_layers=2, head_dim=32, hidden_dim=256, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
        vocab_size=1000, sliding_window=64, rope_theta=10000.0, moe=MoeArgs(num_experts=4, num_experts_per_tok=2),
    ),
}  # fmt: skip
PROMPT, NEW_TOKENS, REPEATS = 128, 128, 3


def model_args(name: str, layers: Optional[int], batch: int) -> ModelArgs:
    shape = dict(SHAPES[name])
    if layers is not None:
        shape["n_layers"] = layers
    return ModelArgs(max_batch_size=batch, **shape)


def parameter_bytes(args: ModelArgs) -> int:
    """bfloat16 bytes of the whole model."""
    attention = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.hidden_dim * (args.moe.num_experts if args.moe else 1)
    router = args.dim * args.moe.num_experts if args.moe else 0
    return 2 * (args.n_layers * (attention + ffn + router + 2 * args.dim) + 2 * args.vocab_size * args.dim + args.dim)


def layers_that_fit(name: str, device: torch.device, requested: Optional[int]) -> Optional[int]:
    """``requested``, or the most layers with which two copies (ours, transformers') fit in 85% of the GPU."""
    if requested is not None or device.type != "cuda":
        return requested
    free, _ = torch.cuda.mem_get_info(device)
    full = model_args(name, None, 1)
    if 2 * parameter_bytes(full) < 0.85 * free:
        return None
    per_layer = parameter_bytes(model_args(name, 2, 1)) - parameter_bytes(model_args(name, 1, 1))
    fixed = parameter_bytes(model_args(name, 1, 1)) - per_layer
    return max(1, int((0.85 * free / 2 - fixed) // per_layer))


@contextlib.contextmanager
def made_in(device: torch.device, dtype: torch.dtype):
    """Modules built inside are allocated on ``device`` in ``dtype`` directly (no float32 copy
    first: Mixtral 8x7B in float32 would not fit on the GPU)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default_dtype)


def hf_model(args: ModelArgs, device: torch.device, dtype: torch.dtype):
    import transformers

    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        sliding_window=args.sliding_window, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, initializer_range=args.dim**-0.5,
    )  # fmt: skip
    if args.moe is None:
        config, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    else:
        config = transformers.MixtralConfig(
            num_local_experts=args.moe.num_experts, num_experts_per_tok=args.moe.num_experts_per_tok, **common
        )
        cls = transformers.MixtralForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with warnings.catch_warnings(), made_in(device, dtype):
        warnings.simplefilter("ignore")
        model = cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.uniform_(0.8, 1.2)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
    return model.eval()


def ours_from_hf(hf, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    return build_model(args, hf_to_published(hf.state_dict().items(), args), "transformers", device=device, dtype=dtype)


def ours_random(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Ours alone, random weights drawn as ``hf_model`` draws them (normal, std ``dim ** -0.5``;
    norms uniform in [0.8, 1.2]; embeddings normal)."""
    torch.manual_seed(0)
    with made_in(device, dtype):
        model = Transformer(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            elif name.startswith("tok_embeddings"):
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, args.dim**-0.5)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def median_runs(run: Callable[[], float], repeats: int) -> tuple[float, float]:
    """(wall seconds of the whole warm-up run, compilation included; median of what ``repeats``
    runs return)."""
    start = time.perf_counter()
    run()
    warm = time.perf_counter() - start
    return warm, statistics.median(run() for _ in range(repeats))


# --------------------------------------------------------------------------- decode


def ours_decode(model: Transformer, prompts: List[List[int]], mode: str, tokens_out: list) -> float:
    """Seconds from the first new token to the last (``NEW_TOKENS - 1`` steps)."""
    device = model.device
    first: List[float] = []

    def on_token(i: int, token: int) -> None:
        if not first:
            first.append(time.perf_counter())

    generated, _ = generate(
        prompts, model, max_tokens=NEW_TOKENS, decode=mode, on_token=on_token, prompt_logprobs=False
    )
    sync(device)
    seconds = time.perf_counter() - first[0]
    tokens_out[:] = generated
    return seconds


@torch.inference_mode()
def hf_eager_decode(hf, prompts: List[List[int]], tokens_out: list) -> float:
    device = hf.device
    result = hf(torch.tensor(prompts, device=device), use_cache=True, logits_to_keep=1)
    past, tokens = result.past_key_values, result.logits[:, -1].argmax(-1)
    out = [tokens]
    sync(device)
    start = time.perf_counter()
    for _ in range(NEW_TOKENS - 1):
        result = hf(tokens[:, None], past_key_values=past, use_cache=True)
        past, tokens = result.past_key_values, result.logits[:, -1].argmax(-1)
        out.append(tokens)
    sync(device)
    seconds = time.perf_counter() - start
    tokens_out[:] = torch.stack(out, 1).tolist()
    return seconds


@torch.inference_mode()
def hf_compiled_generate(hf, prompts: List[List[int]], new_tokens: int) -> float:
    device = hf.device
    input_ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    hf.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, cache_implementation="static", pad_token_id=0,
    )  # fmt: skip
    sync(device)
    return time.perf_counter() - start


def step_matrices(model: Transformer, batch: int) -> List[torch.Tensor]:
    """Every weight matrix a decode step of ``batch`` rows reads (MoE: ``min(E, B * k)`` experts)."""
    matrices: List[torch.Tensor] = []
    for layer in model.layers.values():
        attention = layer.attention
        matrices += [attention.wq.weight, attention.wk.weight, attention.wv.weight, attention.wo.weight]
        ffn = layer.feed_forward
        if isinstance(ffn, MoeLayer):
            matrices.append(ffn.gate.weight)
            for e in range(min(ffn.w1.shape[0], batch * ffn.args.num_experts_per_tok)):
                matrices += [ffn.w1[e], ffn.w3[e], ffn.w2[e]]
        else:
            matrices += [ffn.w1.weight, ffn.w3.weight, ffn.w2.weight]
    return matrices + [model.output.weight]


def cuda_graph_of(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``run`` captured as a CUDA graph, after two warm-up calls on a side stream (cuBLAS picks
    its kernels and compiled code compiles outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


@torch.inference_mode()
def floor_step_seconds(model: Transformer, batch: int, repeats: int = 20) -> float:
    """One replay of a CUDA graph that reads each matrix of a step once (``F.linear``, B rows)."""
    device = model.device
    matrices = step_matrices(model, batch)
    inputs = {m.shape[1]: torch.randn(batch, m.shape[1], device=device, dtype=m.dtype) for m in matrices}

    def read_all() -> None:
        for m in matrices:
            F.linear(inputs[m.shape[1]], m)

    if device.type != "cuda":
        start = time.perf_counter()
        read_all()
        return time.perf_counter() - start
    graph = cuda_graph_of(read_all)
    graph.replay()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph.replay()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def first_difference(a: List[List[int]], b: List[List[int]]) -> Optional[int]:
    for row_a, row_b in zip(a, b):
        for index, (x, y) in enumerate(zip(row_a, row_b)):
            if x != y:
                return index
    return None


def bench_decode(
    ours: Transformer, hf, batch: int, repeats: int, hf_compile: bool, log, modes=("eager", "compiled")
) -> Dict:
    """One batch's decode row; ``hf`` None: ours and the floor only; ours in ``modes``."""
    vocab = ours.args.vocab_size
    prompts = random_prompts(batch, PROMPT, vocab, seed=batch)
    steps = NEW_TOKENS - 1
    row: Dict = {"batch": batch, "prompt": PROMPT, "new_tokens": NEW_TOKENS}
    ours_tokens: list = []
    for mode, label in (("eager", "ours_eager"), ("compiled", "ours_fast")):
        if mode not in modes:
            continue
        warm, seconds = median_runs(lambda: ours_decode(ours, prompts, mode, ours_tokens), repeats)
        row[label] = batch * steps / seconds
        if mode == "compiled":
            row["ours_fast_compile_s"] = warm
        log(f"  b{batch} {label}: {row[label]:.1f} tok/s")
    if hf is not None:
        bench_transformers_decode(hf, prompts, ours_tokens, repeats, hf_compile, row, log)
    row["floor"] = batch / floor_step_seconds(ours, batch)
    log(f"  b{batch} floor: {row['floor']:.1f} tok/s")
    return row


def bench_transformers_decode(hf, prompts, ours_tokens: list, repeats: int, hf_compile: bool, row: Dict, log) -> None:
    """transformers' cells of a decode row (eager, and compiled unless ``hf_compile`` is False)."""
    batch, steps = len(prompts), NEW_TOKENS - 1
    hf_tokens: list = []
    _, seconds = median_runs(lambda: hf_eager_decode(hf, prompts, hf_tokens), repeats)
    row["transformers_eager"] = batch * steps / seconds
    row["first_difference"] = first_difference(ours_tokens, hf_tokens)
    log(f"  b{batch} transformers_eager: {row['transformers_eager']:.1f} tok/s (first difference {row['first_difference']})")
    if hf_compile:
        try:
            warm, full = median_runs(lambda: hf_compiled_generate(hf, prompts, NEW_TOKENS), repeats)
            one = statistics.median(hf_compiled_generate(hf, prompts, 1) for _ in range(repeats))
            row["transformers_compiled"] = batch * steps / max(full - one, 1e-9)
            row["transformers_compiled_compile_s"] = warm
            log(f"  b{batch} transformers_compiled: {row['transformers_compiled']:.1f} tok/s")
        except Exception as error:  # report it, keep the other rows
            row["transformers_compiled_error"] = f"{type(error).__name__}: {error}"[:300]
            log(f"  b{batch} transformers_compiled failed: {row['transformers_compiled_error']}")


GEMLITE = "-gemlite"  # a scheme's suffix: its dense weights through GemLite (kernels/linear/gemlite.py)
FLOAT32 = "-f32"  # after GEMLITE: GemLite's outputs in float32, converted by the compiled step (Tuning.gemlite_float32_outputs)


def quantized_with(model: Transformer, scheme: str) -> Transformer:
    """``model`` quantized to ``scheme`` (``int8``, ``int4-128-gemlite``...) in place: with the
    ``-gemlite`` suffix through GemLite's kernels (an error where it does not import; ``-f32``
    after it: GemLite's outputs in float32), without it through PyTorch's (int8 compiled, tinygemm)
    even where GemLite is installed."""
    float32 = scheme.endswith(GEMLITE + FLOAT32)
    scheme = scheme.removesuffix(FLOAT32)
    if not scheme.endswith(GEMLITE):
        with mock.patch.object(gemlite_cuda, "library", lambda: None):
            return quantize_model(model, scheme)
    if gemlite_cuda.library() is None:
        raise RuntimeError("GemLite does not import here: install it (pip install -e '.[cuda]')")
    use_formats(model, dataclasses.replace(tuning_of(model), gemlite_float32_outputs=float32))  # read by quantize_model
    return quantize_model(model, scheme[: -len(GEMLITE)])


def bench_quantized_decode(
    model: Transformer, scheme: str, repeats: int, float_tokens: list, in_place: bool, modes, log,
    gathered_int8: bool = False,
) -> Dict:
    """Batch-1 decode of ``model`` quantized to ``scheme``: a copy (the float model stays), or
    with ``in_place`` the model itself. ``gathered_int8``: ``Tuning.gathered_int8_experts`` on (the
    row says whether the experts kept the plain int8 values that path reads)."""
    quantized = quantized_with(model if in_place else copy.deepcopy(model), scheme)
    prompts = random_prompts(1, PROMPT, model.args.vocab_size, seed=1)
    row: Dict = {"scheme": scheme, "batch": 1}
    if gathered_int8:
        use_formats(quantized, dataclasses.replace(tuning_of(quantized), gathered_int8_experts=True))
        moes = [m for m in quantized.modules() if isinstance(m, MoeLayer)]
        row["gathered_int8_experts"] = bool(moes) and all(plain_int8(m) for m in moes)
    tokens: list = []
    for mode, label in (("eager", "ours_eager"), ("compiled", "ours_fast")):
        if mode not in modes:
            continue
        warm, seconds = median_runs(lambda: ours_decode(quantized, prompts, mode, tokens), repeats)
        row[label] = (NEW_TOKENS - 1) / seconds
        if mode == "compiled":
            row["ours_fast_compile_s"] = warm
        log(f"  {scheme} b1 {label}: {row[label]:.1f} tok/s")
    if float_tokens:
        row["same_tokens"] = first_difference(tokens, float_tokens) or len(tokens[0])
    row["in_place"] = in_place
    return row  # the quantized copy is freed here, before the next scheme is made


# --------------------------------------------------------------------------- prefill


def peak_over(device: torch.device, run: Callable[[], None]) -> tuple[float, int]:
    """(seconds, peak bytes allocated over what was allocated before) of one run."""
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    run()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return seconds, peak


@torch.inference_mode()
def bench_prefill(ours: Transformer, hf, length: int, repeats: int, log) -> Dict:
    device = ours.device
    prompt = random_prompts(1, length, ours.args.vocab_size, seed=length)

    def run_ours() -> None:
        cache = ours.make_cache(1, max_seqlen=length + 1)
        cache.start_sequences(1)
        prefill(ours, cache, prompt, default_chunk_size(1))

    def run_hf() -> None:
        hf(torch.tensor(prompt, device=device), use_cache=True, logits_to_keep=1)

    row: Dict = {"tokens": length}
    for label, run in (("ours", run_ours), ("transformers", run_hf))[: 1 if hf is None else 2]:
        run()  # warm-up
        measured = [peak_over(device, run) for _ in range(repeats)]
        row[f"{label}_tok_s"] = length / statistics.median(s for s, _ in measured)
        row[f"{label}_peak_gb"] = max(p for _, p in measured) / 1e9
        log(f"  prefill {length} {label}: {row[f'{label}_tok_s']:.0f} tok/s, peak +{row[f'{label}_peak_gb']:.2f} GB")
    return row


# --------------------------------------------------------------------------- main


def machine(device: torch.device) -> Dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    return info


def table(results: Dict) -> str:
    lines = ["| model (layers) | batch | ours eager | ours fast | transformers eager | transformers compiled | floor |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, model in results["models"].items():
        for row in model["decode"]:
            cells = [f"{row.get(k, float('nan')):.1f}" for k in
                     ("ours_eager", "ours_fast", "transformers_eager", "transformers_compiled", "floor")]  # fmt: skip
            lines.append(f"| {name} ({model['layers']}) | {row['batch']} | " + " | ".join(cells) + " |")
    lines += ["", "| model (layers) | prefill tokens | ours tok/s | transformers tok/s | ours peak GB | transformers peak GB |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    nan = float("nan")
    for name, model in results["models"].items():
        for row in model["prefill"]:
            lines.append(
                f"| {name} ({model['layers']}) | {row['tokens']} | {row['ours_tok_s']:.0f} "
                f"| {row.get('transformers_tok_s', nan):.0f} "
                f"| {row['ours_peak_gb']:.2f} | {row.get('transformers_peak_gb', nan):.2f} |"
            )
    quantized = [(name, model, row) for name, model in results["models"].items() for row in model.get("quantized", [])]
    if quantized:
        lines += ["", "| model (layers) | weights | batch | ours eager | ours fast | leading tokens equal to bfloat16 |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, model, row in quantized:
            cells = [f"{row.get(k, nan):.1f}" for k in ("ours_eager", "ours_fast")] + [str(row.get("same_tokens"))]
            lines.append(f"| {name} ({model['layers']}) | {row['scheme']} | 1 | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--models", nargs="+", default=["mistral-7b", "mixtral-8x7b"], choices=SHAPES)
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default: the real count, "
                        "or for Mixtral the most that fit twice on the GPU)")  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192], help="prefill lengths")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-hf-compile", action="store_true", help="skip transformers + StaticCache + torch.compile")
    schemes = ["int8", "int4", "int4-128", "nf4"]
    gemlites = [s + GEMLITE + n for s in schemes if s.startswith("int") for n in ("", FLOAT32)]
    parser.add_argument("--quantize", nargs="*", default=["int8", "int4"], choices=schemes + gemlites,
                        help="quantized decode rows (-gemlite: through GemLite's kernels; -f32 after it: "
                        "its outputs in float32)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                        help="decode modes of ours (without eager: no eager rows, no token agreement)")  # fmt: skip
    parser.add_argument("--without-transformers", action="store_true", help="ours alone, every layer, random weights")
    parser.add_argument("--gathered-int8-experts", action="store_true",
                        help="Tuning.gathered_int8_experts: the chosen int8 experts as one gathered, dequantize-where-read "
                             "product per projection (needs --quantize int8, PyTorch's kernels: the plain int8 values)")
    parser.add_argument("--triton-experts", action="store_true",
                        help="Tuning.triton_experts: Mixtral's chosen experts (bfloat16, int8, int4) through the two Triton "
                             "kernels of fast/triton_experts.py at every batch (needs PyTorch's kernels for the "
                             "experts: --quantize int8 int4, not -gemlite)")  # fmt: skip
    parser.add_argument("--triton-dense", action="store_true",
                        help="Tuning.triton_dense: quantized products of a few rows (int8, int4: PyTorch's layouts, not "
                             "-gemlite) through the same kernels, each weight read as one expert")  # fmt: skip
    parser.add_argument("--grouped-experts", action="store_true",
                        help="Tuning.grouped_experts: where B * k >= E, the experts as one grouped GEMM per projection "
                             "(torch._grouped_mm) instead of every expert on every row")  # fmt: skip
    options = parser.parse_args(argv)
    device = torch.device(options.device)
    dtype = torch.bfloat16
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results: Dict = {"machine": machine(device), "dtype": str(dtype), "models": {}, "grouped_experts": options.grouped_experts,
                     "triton_experts": options.triton_experts, "triton_dense": options.triton_dense}

    def save() -> None:
        if options.out is not None:
            options.out.write_text(json.dumps(results, indent=1))

    alone = options.without_transformers
    for name in options.models:
        layers = options.layers if alone else layers_that_fit(name, device, options.layers)
        args = model_args(name, layers, max(options.batches, default=1))
        log(f"{name}: {args.n_layers} layers, {parameter_bytes(args) / 1e9:.1f} GB of weights")
        hf = None if alone else hf_model(args, device, dtype)
        ours = ours_random(args, device, dtype) if alone else ours_from_hf(hf, args, device, dtype)
        if options.grouped_experts or options.triton_experts or options.triton_dense:
            use_formats(ours, dataclasses.replace(tuning_of(ours), grouped_experts=options.grouped_experts,
                                                  triton_experts=options.triton_experts, triton_dense=options.triton_dense))  # fmt: skip
        entry: Dict = {"layers": args.n_layers, "weights_gb": parameter_bytes(args) / 1e9, "decode": [], "prefill": []}
        if alone:
            entry["transformers"] = False
        results["models"][name] = entry
        for batch in options.batches:
            entry["decode"].append(
                bench_decode(ours, hf, batch, options.repeats, not options.no_hf_compile, log, options.modes)
            )
            save()
        for length in options.prefill:
            entry["prefill"].append(bench_prefill(ours, hf, length, options.repeats, log))
            save()
        del hf
        if options.quantize:
            float_tokens: list = []  # the bfloat16 model's, where eager runs
            if "eager" in options.modes:
                ours_decode(ours, random_prompts(1, PROMPT, args.vocab_size, seed=1), "eager", float_tokens)
            entry["quantized"] = []
            for scheme in options.quantize:
                in_place = device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 1.2 * parameter_bytes(args)
                row = bench_quantized_decode(ours, scheme, options.repeats, float_tokens, in_place, options.modes, log,
                                             options.gathered_int8_experts)  # fmt: skip
                entry["quantized"].append(row)
                save()
                if in_place:
                    break
        del ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(results))
    save()
    if options.out is not None:
        from plots import plot_after_run  # bench/plots.py: the plot beside the JSON

        plot_after_run("gpu", options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
