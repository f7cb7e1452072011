"""How many cache rows (sequences at once) a server gets: given, or from a memory budget.

As vLLM's ``gpu_memory_utilization``: a fraction of the device's memory (of the RAM on a
CPU) is the budget; the weights and the measured peak of one prefill step of
``prefill_tokens`` tokens come off it, and what is left is cut into rows. With a sliding
window each row costs exactly W slots however long its sequence runs, so the number of
rows is final before the first request; without one, a row holds ``max_model_len`` slots. Each
layer's buffer is sized on its own (``model.cache.layer_cache_sizes``): a model that mixes
full-attention and windowed layers (Ministral 8B: one in four full) costs a row
``max_model_len`` slots in its full layers and W in the others, and its row's bytes are the sum.

Worked example (Mistral 7B shape in bfloat16: 32 layers, 8 KV heads of 128, window 4096):
a row is ``2 * 32 * 4096 * 8 * 128 * 2`` bytes = 512 MiB; with an 80 GB GPU at fraction 0.9
(72 GB), 14.5 GB of weights and a 1 GB step peak, ``(72 - 14.5 - 1) GB / 512 MiB`` = 105 rows.

Slack (``Engine``'s ``slack``, ``model.cache.SlackSlots``): each windowed layer of a row keeps that
many slots more, so a row costs ``slack`` more slots in them; with a slack of 512 the row above is
``2 * 32 * (4096 + 512) * 8 * 128 * 2`` bytes = 576 MiB, and 93 rows fit. Speculative decoding
(``--draft-model``, ``--speculative-ngram``) needs a slack of at least k, the most guesses a step checks:
the prefix reuse slack covers it where it is larger, else it costs k / W more per row (k = 4, W = 4096:
0.1%, 0.5 MiB of the row above). A draft model's weights and its own cache (its rows, its window) are
loaded beside the model's and are not counted in the budget: a small draft's are a few percent of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mixtral_infer.errors import GenerationError
from mixtral_infer.formats.packing import packed_numel
from mixtral_infer.generation.settings import (
    check_cache_fits,
    free_memory,
    gigabytes,
    kv_cache_bytes,
    meminfo_bytes,
    proc_kb_field,
)
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.kernels.linear import gemlite as gemlite_cuda
from mixtral_infer.quant.weights import QuantizedParameter

DEFAULT_MEMORY_FRACTION = 0.9
DEFAULT_ROW_CAP = 64  # rows made from a budget are at most this many unless --max-rows says otherwise


@dataclasses.dataclass
class RowPlan:
    rows: int
    slots: int  # per row: the window, or max_model_len (the longest buffer of a layer)
    row_bytes: int
    weight_bytes: int
    step_peak_bytes: Optional[int]  # measured; None when rows were given
    budget_bytes: Optional[int]
    reason: str
    slots_text: str = ""  # each kind of layer's slots where they differ: "8192 (9 full-attention layers) / 32768"

    def describe(self) -> str:
        parts = [
            f"{self.rows} cache rows of {self.slots_text or self.slots} slots ({size(self.rows * self.row_bytes)}, "
            f"{size(self.row_bytes)} per row)",
            f"weights {size(self.weight_bytes)}",
        ]
        if self.step_peak_bytes is not None:
            parts.append(f"prefill step peak {size(self.step_peak_bytes)}")
        if self.budget_bytes is not None:
            parts.append(f"budget {size(self.budget_bytes)}")
        return ", ".join(parts) + f": {self.reason}"


def size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.2f} MiB"


def total_memory(device: torch.device) -> Optional[int]:
    """Bytes of memory of the device (RAM for the CPU), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return meminfo_bytes("MemTotal")


@torch.inference_mode()
def measure_step_peak(model: Transformer, n_tokens: int, slots: int) -> Optional[int]:
    """Peak memory a forward pass of ``n_tokens`` prompt tokens adds, measured by running one.

    CUDA: the allocator's peak. CPU (Linux): the resident set's high-water mark, reset
    through ``/proc/self/clear_refs`` first; None where that cannot be read.
    """
    device = model.device
    cache = model.make_cache(1, max_seqlen=slots)
    tokens = torch.ones(n_tokens, dtype=torch.long, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model(tokens, [n_tokens], cache, logit_rows=[n_tokens - 1])
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    before = proc_kb_field("/proc/self/status", "VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current resident set
    except OSError:
        return None
    model(tokens, [n_tokens], cache, logit_rows=[n_tokens - 1])
    peak = proc_kb_field("/proc/self/status", "VmHWM")
    return None if peak is None or before is None else max(peak - before, 0)


def weight_bytes(model: Transformer) -> int:
    """Bytes the model's weights take: parameters, buffers (quantized weights' integers and scales),
    matrices packed for oneDNN (``fast.cpu_packed``), w8a8's int8 matrices packed for fbgemm and
    GemLite's int4 words on CUDA (``kernels.linear.gemlite``). Tensors that are views of one another
    (nf4 weights joined side by side: each weight's bytes a view of its group's) count once."""
    plain = held_bytes([*model.parameters(), *model.buffers()])
    quantized = [m for m in model.modules() if isinstance(m, QuantizedParameter)]
    fbgemm = sum(m.prepacked.numel() for m in quantized if m.prepacked is not None)  # a byte per weight
    return plain + packed_numel(model) * model.dtype.itemsize + fbgemm + gemlite_cuda.held_bytes(quantized)


def held_bytes(tensors) -> int:
    """Bytes of memory ``tensors`` span, each byte once: the union, per storage, of the byte ranges
    the tensors reach (a view inside another tensor adds nothing). Example: ``w`` of 1000 bytes and
    ``w[:300]`` hold 1000 bytes."""
    spans = {}  # storage -> [(first byte, end)]
    for t in tensors:
        if t.numel() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        reach = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1  # elements, first to last
        storage = id(t) if t.is_meta else t.untyped_storage().data_ptr()  # meta tensors have no memory to share
        spans.setdefault(storage, []).append((start, start + reach * t.element_size()))
    total = 0
    for ranges in spans.values():
        end = -1
        for first, stop in sorted(ranges):
            total += max(0, stop - max(first, end))
            end = max(end, stop)
    return total


def plan_rows(
    model: Transformer,
    *,
    prefill_tokens: int,
    max_rows: Optional[int] = None,
    memory_fraction: Optional[float] = None,
    max_model_len: Optional[int] = None,
    slack: int = 0,
) -> RowPlan:
    """The rows: ``max_rows`` when given alone; else from ``memory_fraction`` (default 0.9) of
    the device's memory, at most ``max_rows`` (default ``DEFAULT_ROW_CAP``). ``slack``: the slots
    a row keeps beside each windowed layer's buffer (the engine's ``slack``), counted in its bytes."""
    windows = model.args.layer_windows
    slots = max_model_len if model.args.full_attention else max(w for w in windows if w is not None)
    if slots is None:
        what = "without a sliding window" if model.args.sliding_window is None else "with full-attention layers"
        raise GenerationError(f"a model {what} needs --max-model-len (tokens per sequence) to size its rows")
    row_bytes = kv_cache_bytes(model.args, 1, slots, model.dtype, model.parallel) + slack_bytes(model, slack)
    text = layer_slots_text(windows, slots)
    if slack:
        text = f"{text or slots} (and {slack} slack)"
    weights = weight_bytes(model)
    device = model.device
    if max_rows is not None and memory_fraction is None:
        check_cache_fits(max_rows * row_bytes, f"--max-rows {max_rows}: the KV cache", device, "lower --max-rows")
        return RowPlan(max_rows, slots, row_bytes, weights, None, None, "--max-rows", text)
    fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    total = total_memory(device)
    if total is None:
        raise GenerationError(f"the memory of {device} is unknown: give --max-rows")
    budget = int(fraction * total)
    peak = measure_step_peak(model, prefill_tokens, slots)
    left = budget - weights - (peak or 0)
    free = free_memory(device)
    if free is not None:
        left = min(left, free - (peak or 0))  # on a shared machine, what is free now bounds the cache too
    fit = left // row_bytes
    if fit < 1:
        raise GenerationError(
            f"--memory-fraction {fraction}: {gigabytes(budget)} of {gigabytes(total)} leaves no room for one row of "
            f"{row_bytes / 2**20:.1f} MiB after {gigabytes(weights)} of weights and the prefill step: raise it or lower "
            "--prefill-tokens"
        )
    cap = max_rows if max_rows is not None else DEFAULT_ROW_CAP
    reason = f"{fit} fit in --memory-fraction {fraction} of {size(total)}"
    if fit > cap:
        reason += f", capped at {cap}" + (" (--max-rows)" if max_rows is not None else " (give --max-rows for more)")
    return RowPlan(int(min(fit, cap)), slots, row_bytes, weights, peak, budget, reason, text)


def slack_bytes(model: Transformer, slack: int) -> int:
    """Bytes a row's slack slots take on this rank: keys and values of ``slack`` slots in each windowed layer."""
    args, parallel = model.args, model.parallel
    windowed = sum(args.layer_windows[i] is not None for i in parallel.layer_range(args.n_layers))
    return 2 * slack * windowed * len(parallel.share(args.n_kv_heads)) * args.head_dim * model.dtype.itemsize


def layer_slots_text(windows, max_seqlen: int) -> str:
    """The slots of a row's layers where they differ (``""`` where every layer holds as many):
    ``layer_slots_text([None, 8, 8, 8], 64) == "64 (1 full-attention layer) / 8 (3 windowed)"``."""
    from mixtral_infer.model.cache import layer_cache_sizes

    sizes = layer_cache_sizes(windows, max_seqlen)
    if len(set(sizes)) == 1:
        return ""
    full = sum(w is None for w in windows)
    parts = []
    for value in sorted(set(sizes), reverse=True):
        count = sizes.count(value)
        kinds = {w is None for w, s in zip(windows, sizes) if s == value}
        what = (f"{count} full-attention layer{'s' if count > 1 else ''}" if kinds == {True} and count == full
                else f"{count} windowed" if kinds == {False} else f"{count} layers")  # fmt: skip
        parts.append(f"{value} ({what})")
    return " / ".join(parts)
