"""llama.cpp's ``.gguf`` files read as models, through the ``gguf`` package (llama.cpp's own reader).

A GGUF file holds, in one file, the hyperparameters and the tokenizer in its metadata and the
weights, often quantized in blocks. Mistral 7B and Mixtral 8x7B are written with architecture
``llama``; any other architecture is refused in one line.

**Hyperparameters** (``args_from_gguf``): ``llama.embedding_length`` (dim), ``block_count``,
``feed_forward_length``, ``attention.head_count``, ``attention.head_count_kv``,
``attention.key_length`` (else dim / heads), ``attention.layer_norm_rms_epsilon``,
``rope.freq_base`` (else 10000, llama.cpp's default), ``expert_count`` and ``expert_used_count``
(Mixtral), and the vocabulary size from ``llama.vocab_size`` or the tokenizer's list.
llama.cpp's converter writes no sliding window for ``llama`` (llama.cpp attends to every earlier
position in Mistral 7B v0.1 too); ``llama.attention.sliding_window`` is read where a file has it,
else the model attends fully (``sliding_window=None``).

**Names**: ``token_embd`` -> ``tok_embeddings``, ``blk.N.attn_q/attn_k/attn_v/attn_output`` ->
``layers.N.attention.wq/wk/wv/wo``, ``ffn_gate/ffn_up/ffn_down`` -> ``feed_forward.w1/w3/w2``,
``attn_norm`` / ``ffn_norm`` -> ``attention_norm`` / ``ffn_norm``, ``output_norm`` -> ``norm``,
``output`` -> ``output``; Mixtral's stacked experts ``ffn_gate_exps/ffn_up_exps/ffn_down_exps``
(E, I, D) / (E, D, I) -> ``feed_forward.experts.J.w1/w3/w2`` (files converted before April 2024 hold
one tensor per expert, ``blk.N.ffn_gate.J`` ...: read too), the router ``ffn_gate_inp`` ->
``feed_forward.gate``. A file without ``output.weight`` ties the output to the embeddings, as
llama.cpp does.

**Rotary layout**: llama.cpp's converter permutes transformers' q/k rows (``permute`` in
``convert_hf_to_gguf.py``) back to Meta's adjacent-pair layout, which llama.cpp's "normal" rope
rotates; that is the published layout this package computes in, so GGUF's q and k rows are taken
as they are (transformers' GGUF loader, whose rope rotates halves, undoes the permutation:
``reverse_permute_weights``).

**Weights**: ``F32``, ``F16``, ``BF16`` as stored. ``Q4_0`` matrices (the weights the package
quantizes: ``wq wk wv wo``, ``w1 w2 w3``, the experts', ``output``) are kept in their blocks as int4
weights with groups of 32 (``q4_0_as_int4``: the same integers and scales, no requantization), where
``load_model`` places them (``GgufLoading``): without ``--quantize``, or with ``int4`` (groups of 32,
the same weights). Every other type, and ``Q4_0`` embeddings and routers, is dequantized by
``gguf.quants.dequantize`` to float32, then to the load dtype, or quantized to ``--quantize`` (a
``Q4_0`` file asked for ``int8`` or ``nf4`` is dequantized, then quantized); with a LoRA adapter every
weight is dequantized, to merge it. One stderr line says which types are kept and which dequantized.

The scales are ``Q4_0``'s float16 ``d``: held exactly in float32 and float16; bfloat16 (the int4
kernels' dtype, and a ``Q4_0`` file's default) rounds each to 8 significant bits, as every scale the
package computes (``quant/weights.py``), a relative change of at most 2^-9.

``Q8_0`` (a float16 scale per 32 int8 values) is dequantized: the package's int8 weights have one
scale per output row, and each of their back-ends is built on that (``_weight_int8pack_mm``, fbgemm's
w8a8 packing, GemLite's and Triton's int8 kernels, the MoE strategies' gathered experts, the column
blocks of compiled decoding, the quantized folders' ``(OUT,)`` scales: about thirty places). A grouped
int8 would be a weight kind of its own, refused by all of them and read by a new back-end
(dequantize per group, then ``F.linear``), so every product would dequantize the whole weight: as
slow as the float weights for prompts, slower when decoding, for half their memory. Requantizing to
one scale a row is what ``--quantize int8`` does, said in the line.

Checked before any weight is read: the architecture, the metadata, each tensor's type (one the reader
does not know is named), that each tensor's bytes lie inside the file (a truncated file), that every
tensor the model needs is there and has its shape: one line naming the file and the tensor.
"""

from __future__ import annotations

import re
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import numpy as np
import torch

from mixtral_infer.checkpoint.params import checked_args
from mixtral_infer.checkpoint.weight_shapes import published_shape
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.gguf_reader import field, open_reader
from mixtral_infer.kernels.linear import prepare_weight
from mixtral_infer.model.moe import MoeArgs
from mixtral_infer.model.transformer import ModelArgs
from mixtral_infer.quant.model import is_quantized_published
from mixtral_infer.quant.scheme import QuantScheme
from mixtral_infer.quant.weights import QuantizedWeight, check_scales_fit
from mixtral_infer.tuning import Tuning

GGUF_SUFFIX = ".gguf"
ARCHITECTURE = "llama"  # how llama.cpp's converter writes Mistral and Mixtral

_GLOBAL = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight", "output.weight": "output.weight"}
_BLOCK = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "ffn_gate_inp": "feed_forward.gate",
}
_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
_ONE_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")  # files converted before April 2024
_ONE_EXPERT_PART = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; a folder never is)."""
    return str(path).lower().endswith(GGUF_SUFFIX) and not Path(path).is_dir()


def args_from_gguf(reader, source: str) -> ModelArgs:
    """ModelArgs from a GGUF file's metadata (module docstring); ConfigError naming the key."""
    arch = field(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise CheckpointError(f"{source}: architecture {arch!r}, only {ARCHITECTURE!r} (Mistral, Mixtral) is read")

    def number(key: str, kind: type = int, default: object = ConfigError) -> object:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            if default is ConfigError:
                raise ConfigError(f"{source}: metadata {arch}.{key} missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ConfigError(f"{source}: metadata {arch}.{key}={value!r} must be a {kind.__name__}")
        return kind(value)

    dim, n_heads = number("embedding_length"), number("attention.head_count")
    if n_heads < 1:
        raise ConfigError(f"{source}: metadata {arch}.attention.head_count={n_heads} must be positive")
    vocab = number("vocab_size", default=None)
    if vocab is None:
        tokens = field(reader, "tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ConfigError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens in the metadata")
        vocab = len(tokens)
    experts = number("expert_count", default=0)
    moe = MoeArgs(experts, number("expert_used_count")) if experts else None
    window = number("attention.sliding_window", default=None)
    return checked_args(
        dict(
            dim=dim,
            n_layers=number("block_count"),
            head_dim=number("attention.key_length", default=dim // n_heads),
            hidden_dim=number("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=number("attention.head_count_kv", default=n_heads),
            norm_eps=number("attention.layer_norm_rms_epsilon", float),
            vocab_size=vocab,
            rope_theta=number("rope.freq_base", float, default=10000.0),
            sliding_window=window or None,
            moe=moe,
        ),
        source,
    )


def published_names(name: str, args: ModelArgs) -> Optional[List[str]]:
    """The published names a GGUF tensor holds (several for Mixtral's stacked experts), None if unknown."""
    if name in _GLOBAL:
        return [_GLOBAL[name]]
    expert = _ONE_EXPERT.match(name)
    if expert is not None and args.moe is not None:
        return [f"layers.{expert[1]}.feed_forward.experts.{expert[3]}.{_ONE_EXPERT_PART[expert[2]]}.weight"]
    match = _BLK.match(name)
    if match is None:
        return None
    layer, part = match[1], match[2]
    if part in _BLOCK:
        return [f"layers.{layer}.{_BLOCK[part]}.weight"]
    if part in _EXPERTS and args.moe is not None:
        return [f"layers.{layer}.feed_forward.experts.{j}.{_EXPERTS[part]}.weight" for j in range(args.moe.num_experts)]
    return None


def _expected_shape(name: str, args: ModelArgs) -> Optional[Tuple[int, ...]]:
    names = published_names(name, args)
    if names is None:
        return None
    shapes = [published_shape(n, args) for n in names]
    if any(s is None for s in shapes):
        return None
    return (len(names), *shapes[0]) if _is_experts(name) else shapes[0]


def _is_experts(name: str) -> bool:
    """Whether GGUF tensor ``name`` stacks a layer's experts (E, ...)."""
    match = _BLK.match(name)
    return match is not None and match[2] in _EXPERTS


def _numpy_shape(tensor) -> Tuple[int, ...]:
    """A tensor's shape in numpy's (row-major) order: GGUF lists ggml's dimensions innermost first."""
    return tuple(int(n) for n in reversed(list(tensor.shape)))


class GgufFile:
    """A GGUF file, opened and checked (module docstring); nothing but the metadata is read yet."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        source = str(self.path)
        self.reader = open_reader(self.path)
        self.args = args_from_gguf(self.reader, source)
        size = self.path.stat().st_size
        self.tensors = {}
        for tensor in self.reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise CheckpointError(f"{source}: truncated: tensor {tensor.name} ends at byte {end}, the file has {size}")
            if _expected_shape(tensor.name, self.args) is None:
                raise CheckpointError(f"{source}: unexpected tensor {tensor.name}")
            shape, expected = _numpy_shape(tensor), _expected_shape(tensor.name, self.args)
            if shape != expected:
                raise CheckpointError(f"{source}: tensor {tensor.name} has shape {shape}, the model config implies {expected}")
            self.tensors[tensor.name] = tensor
        self.tied_output = "output.weight" not in self.tensors
        needed = ["token_embd.weight", "output_norm.weight"]
        per_layer = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm"]
        per_layer += ["ffn_gate_inp"] if self.args.moe is not None else ["ffn_gate", "ffn_up", "ffn_down"]
        needed += [f"blk.{i}.{part}.weight" for i in range(self.args.n_layers) for part in per_layer]
        for i in range(self.args.n_layers if self.args.moe is not None else 0):  # stacked experts, or one tensor each
            stacked = [f"blk.{i}.{part}.weight" for part in _EXPERTS]
            one_each = [f"blk.{i}.{part}.{j}.weight" for part in _ONE_EXPERT_PART for j in range(self.args.moe.num_experts)]
            needed += stacked if stacked[0] in self.tensors or one_each[0] not in self.tensors else one_each
        missing = [name for name in needed if name not in self.tensors]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{more}")

    def context_length(self) -> object:
        """``llama.context_length``: the longest sequence the file declares (None where absent)."""
        return field(self.reader, f"{ARCHITECTURE}.context_length")

    def kept_scheme(self, quantize: Optional[QuantScheme] = None) -> Optional[QuantScheme]:
        """``Q4_0_SCHEME`` where loading with ``quantize`` keeps some of the file's blocks, else None."""
        kept = any(_keeps_blocks(t.tensor_type.name, name, quantize) for name, t in self._sources())
        return Q4_0_SCHEME if kept else None

    def dequantized_types(self, loading: Optional["GgufLoading"] = None) -> List[str]:
        """The names of the stored types dequantized while loading (not F32, F16, BF16, nor the
        blocks ``loading`` keeps)."""
        return sorted({t.tensor_type.name for name, t in self._sources()
                       if t.tensor_type.name not in _AS_STORED and not _kept(t, name, loading)})  # fmt: skip

    def loading_line(self, loading: Optional["GgufLoading"] = None) -> Optional[str]:
        """The stderr line saying which types are kept in blocks and which dequantized (None: all as stored).

        Example, a Q4_0 file (its embeddings Q4_0 too, its output Q6_K) loaded in bfloat16:
        ``model.gguf: keeping Q4_0 matrices in their blocks as int4 (groups of 32); dequantizing
        Q4_0, Q6_K weights to bfloat16``; with ``--quantize int8``: ``model.gguf: dequantizing Q4_0,
        Q6_K weights to bfloat16, then quantizing the matrices to int8``."""
        kept = sorted({t.tensor_type.name for name, t in self._sources() if _kept(t, name, loading)})
        dequantized = self.dequantized_types(loading)
        parts = [f"keeping {', '.join(kept)} matrices in their blocks as {Q4_0_SCHEME.label}"] if kept else []
        if dequantized:
            dtype = str(loading.dtype).removeprefix("torch.") if loading is not None else "float"
            quantize = loading.quantize if loading is not None else None
            then = f", then quantizing the matrices to {quantize.label}" if quantize is not None else ""
            parts.append(f"dequantizing {', '.join(dequantized)} weights to {dtype}{then}")
        return f"{self.path}: {'; '.join(parts)}" if parts else None

    def _sources(self) -> Iterator[Tuple[str, object]]:
        """(a published name, the GGUF tensor holding it) for each tensor, and the tied output."""
        for tensor in self.tensors.values():
            yield published_names(tensor.name, self.args)[0], tensor
        if self.tied_output:
            yield "output.weight", self.tensors["token_embd.weight"]

    def stored_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the weights: F16/BF16/F32 as stored, float32 for the dequantized."""
        counts: Dict[torch.dtype, int] = {}
        for t in self.tensors.values():
            dtype = _AS_STORED.get(t.tensor_type.name, torch.float32)
            counts[dtype] = counts.get(dtype, 0) + int(t.n_elements)
        return max(counts, key=counts.get)

    def planned(self, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """What ``published_tensors`` yields, in order, as meta tensors (``convert``'s plan); nothing is read."""
        for tensor in self.tensors.values():
            stored = dtype or _AS_STORED.get(tensor.tensor_type.name, torch.float32)
            names, shape = published_names(tensor.name, self.args), _numpy_shape(tensor)
            if _is_experts(tensor.name):
                for name in names:
                    yield name, torch.empty(shape[1:], dtype=stored, device="meta")
            else:
                yield names[0], torch.empty(shape, dtype=stored, device="meta")
        if self.tied_output:
            embeddings = self.tensors["token_embd.weight"]
            stored = dtype or _AS_STORED.get(embeddings.tensor_type.name, torch.float32)
            yield "output.weight", torch.empty(_numpy_shape(embeddings), dtype=stored, device="meta")

    def published_tensors(self, progress=None, select=None,
                          loading: Optional["GgufLoading"] = None) -> Iterator[Tuple[str, object]]:  # fmt: skip
        """Every tensor under its published name, one at a time (experts unstacked); ``select`` as in
        ``Checkpoint.published_tensors`` keeps part of a tensor or skips it. ``loading``: how
        ``load_model`` places the weights; the ``Q4_0`` blocks it keeps come as ``QuantizedWeight``s
        placed so (module docstring), every other tensor as a float tensor."""
        from mixtral_infer.checkpoint.safetensors_reader import apply_selection

        line = self.loading_line(loading)
        if line is not None:
            print(line, file=sys.stderr)
        total, done = len(self.tensors), 0
        sources = [(tensor, published_names(tensor.name, self.args)) for tensor in self.tensors.values()]
        if self.tied_output:  # as llama.cpp does: the output is the embeddings
            sources.append((self.tensors["token_embd.weight"], ["output.weight"]))
        for tensor, names in sources:
            tied = names == ["output.weight"] and tensor.name == "token_embd.weight"
            wanted = [(n, select(n) if select is not None else None) for n in names]
            if select is None or any(s is not None for _, s in wanted):
                experts = _is_experts(tensor.name) and not tied
                if _kept(tensor, names[0], loading):
                    blocks = _q4_0_blocks(tensor)  # (..., OUT, IN/32, 18)
                    for j, (name, selection) in enumerate(wanted):
                        if select is None or selection is not None:
                            part = _selected_blocks(blocks[j] if experts else blocks, selection, name, str(self.path))
                            yield name, _placed_int4(part, loading, f"{self.path}: tensor {tensor.name}")
                else:
                    value = _to_torch(tensor, str(self.path), _float_dtype(loading))
                    pairs = [(n, value[j]) for j, n in enumerate(names)] if experts else [(names[0], value)]
                    for (name, part), (_, selection) in zip(pairs, wanted):
                        if select is None:
                            yield name, part
                        elif selection is not None:
                            yield name, apply_selection(part, selection)
            if not tied:
                done += 1
                if progress is not None:
                    progress(done, total)


def _float_dtype(loading: Optional["GgufLoading"]) -> torch.dtype:
    """The dtype dequantized tensors come in: the model's where ``load_model`` places them as they are
    (what it would round them to) and it has float32's range, else float32 (to quantize again, to merge
    an adapter, to convert; and for float16, whose range check, ``check_finite``, tells a weight past
    its range from a damaged file by the float32 values)."""
    placed_as_is = loading is not None and loading.quantize is None and loading.keep_blocks
    return loading.dtype if placed_as_is and loading.dtype in (torch.bfloat16, torch.float32) else torch.float32


@dataclass(frozen=True)
class GgufLoading:
    """How ``load_model`` places the weights, which ``GgufFile.published_tensors`` needs to keep blocks:
    the model's dtype (the int4 scales'), its device, the tuning whose back-ends lay the weights out,
    ``quantize`` (``--quantize``), and ``keep_blocks`` (False with a LoRA adapter: it merges into floats)."""

    dtype: torch.dtype
    device: torch.device
    tuning: Tuning
    quantize: Optional[QuantScheme] = None
    keep_blocks: bool = True


Q4_0_SCHEME = QuantScheme("int4", 32)  # what a Q4_0 block is: 32 weights (n - 8) * d
Q4_0_BLOCK_BYTES = 18  # the float16 d, then 16 bytes of 4-bit n


def _keeps_blocks(kind: str, name: str, quantize: Optional[QuantScheme]) -> bool:
    """Whether a tensor of GGML type ``kind`` under published ``name`` is kept in its blocks when
    loading with ``quantize``: a Q4_0 matrix the package quantizes, not asked for another scheme."""
    return kind == "Q4_0" and is_quantized_published(name) and quantize in (None, Q4_0_SCHEME)


def _kept(tensor, name: str, loading: Optional[GgufLoading]) -> bool:
    if loading is None or not loading.keep_blocks:
        return False
    return _keeps_blocks(tensor.tensor_type.name, name, loading.quantize)


def _q4_0_blocks(tensor) -> np.ndarray:
    """A Q4_0 tensor's bytes as ``(..., OUT, IN/32, 18)`` blocks, read where the file is mapped."""
    data = np.asarray(tensor.data)  # (..., OUT, IN/32 * 18)
    return data.reshape(*data.shape[:-1], -1, Q4_0_BLOCK_BYTES)


def _selected_blocks(blocks: np.ndarray, selection, name: str, source: str) -> np.ndarray:
    """The blocks ``(OUT, IN/32, 18)`` of a rank's share (``Selection``): rows, then whole blocks of
    columns; a share that cuts a block is refused (ConfigError naming the tensor)."""
    if selection is None:
        return blocks
    if selection.rows is not None:
        blocks = blocks[selection.rows]
    columns = selection.columns
    if columns is not None:
        start, stop = columns.start or 0, columns.stop if columns.stop is not None else blocks.shape[-2] * 32
        if start % 32 or stop % 32 or columns.step not in (None, 1):
            raise ConfigError(f"{source}: {name}: this rank's inputs {start}:{stop} cut Q4_0's blocks of 32; "
                              "choose a tensor_parallel whose shares are whole blocks")  # fmt: skip
        blocks = blocks[:, start // 32 : stop // 32]
    return blocks


def q4_0_as_int4(blocks: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks ``(..., OUT, IN/32, 18)`` as int4 weights with groups of 32: the plain bytes
    ``(..., OUT, IN/2)`` and the float32 scales ``(..., OUT, IN/32)``, the same numbers.

    A block is its float16 scale ``d`` (2 bytes), then 16 bytes: byte ``j`` holds weight ``j`` in its
    low nibble and weight ``j + 16`` in its high one, ``w = d * (n - 8)`` (ggml's ``block_q4_0``). The
    package's int4 weights are ``(n - 8) * scale`` too, with byte ``k`` holding inputs ``2k`` (low)
    and ``2k + 1`` (high): only the nibbles move. ``d`` may be negative (llama.cpp divides the
    largest magnitude by -8, so that weight is ``n = 0``); int4's products are linear in the scale.

    Example: a block ``d = 0.5`` (bytes ``00 38``), ``qs[0] = 0x9F``, ``qs[1] = 0x08``: weight 0 is
    ``0.5 * (15 - 8) = 3.5``, weight 1 is ``0.5 * (8 - 8) = 0``, weight 16 is ``0.5 * (9 - 8) = 0.5``;
    as int4, byte 0 is ``15 | 8 << 4 = 0x8F`` and byte 8 holds weight 16 in its low nibble."""
    blocks = np.asarray(blocks)
    rows = blocks.reshape(-1, *blocks.shape[-2:])  # (R, IN/32, 18)
    values = np.empty((*rows.shape[:2], 16), dtype=np.uint8)  # (R, IN/32, 16)
    scales = np.empty(rows.shape[:2], dtype=np.float32)  # (R, IN/32)

    def convert(start: int, stop: int) -> None:
        part = rows[start:stop]
        scales[start:stop] = part[..., :2].copy().view(np.float16)[..., 0]
        # Byte k < 8 of the int4 block pairs weights 2k, 2k + 1: the low nibbles of qs[2k], qs[2k + 1];
        # byte 8 + k pairs weights 16 + 2k, 17 + 2k: their high nibbles.
        even, odd = part[..., 2::2], part[..., 3::2]  # (rows, IN/32, 8): qs[2k], qs[2k + 1]
        np.bitwise_or(even & 15, odd << 4, out=values[start:stop, :, :8])
        np.bitwise_or(even >> 4, odd & 0xF0, out=values[start:stop, :, 8:])

    for _ in by_row_pieces(convert, rows.shape[0], rows[0].nbytes if rows.shape[0] else 1):
        pass
    return torch.from_numpy(values.reshape(*blocks.shape[:-2], -1)), torch.from_numpy(scales.reshape(blocks.shape[:-1]))


T = TypeVar("T")  # what by_row_pieces' work gives


def by_row_pieces(work: Callable[[int, int], T], rows: int, row_bytes: int) -> Iterator[Tuple[int, int, T]]:
    """``(start, stop, work(start, stop))`` over rows ``0..rows`` in pieces of about 1 MB, in order. As
    many pieces run at once as torch has threads (numpy's array operations let go of the GIL; each
    piece's working copies stay in the cache), while the caller takes the results in its own thread,
    at most twice as many held as there are threads. ``work`` runs in the pool's threads: numpy only,
    where torch's own threads would start a team in each."""
    step = max(1, (1 << 20) // max(row_bytes, 1))
    bounds = [(start, min(start + step, rows)) for start in range(0, rows, step)]
    threads = min(torch.get_num_threads(), len(bounds))
    if threads <= 1:
        for start, stop in bounds:
            yield start, stop, work(start, stop)
        return
    with ThreadPoolExecutor(threads) as pool:
        running = deque()
        for start, stop in bounds:
            running.append((start, stop, pool.submit(work, start, stop)))
            if len(running) > 2 * threads:
                first, last, result = running.popleft()
                yield first, last, result.result()  # a piece's error is raised here
        while running:
            first, last, result = running.popleft()
            yield first, last, result.result()


def _placed_int4(blocks: np.ndarray, loading: GgufLoading, name: str) -> QuantizedWeight:
    """Q4_0 blocks ``(OUT, IN/32, 18)`` as an int4 weight on ``loading``'s device, scales in its dtype,
    in the layout of the back-end that reads it (``prepare_weight``). Scales that are NaN or inf (a
    damaged file), or whose weights pass the dtype's range (float16), are refused by name."""
    values, scales = q4_0_as_int4(blocks)
    largest = float(scales.abs().max()) if scales.numel() else 0.0
    if not np.isfinite(largest):
        raise CheckpointError(f"{name} holds NaN or infinite Q4_0 scales: the file is damaged")
    check_scales_fit(name, largest, Q4_0_SCHEME, loading.dtype, "load in bfloat16 or float32")
    weight = QuantizedWeight(Q4_0_SCHEME, values.to(loading.device), scales.to(loading.device, loading.dtype),
                             values.shape[-1] * 2)  # fmt: skip
    return prepare_weight(weight, loading.tuning)


_AS_STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _to_torch(tensor, source: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor's values: F32/F16/BF16 as stored, any other type dequantized by ``gguf`` to float32 and
    given in ``dtype`` (rounded a piece at a time: no float32 copy of the whole tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = _numpy_shape(tensor)
    kind = tensor.tensor_type
    data = np.asarray(tensor.data)
    if kind == GGMLQuantizationType.F32 or kind == GGMLQuantizationType.F16:
        return torch.from_numpy(np.ascontiguousarray(data).reshape(shape).copy())
    if kind == GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(data).view(np.int16).reshape(shape).copy()
        return torch.from_numpy(raw).view(torch.bfloat16)
    rows = data.reshape(-1, data.shape[-1])  # (R, the bytes of IN values)
    values = torch.empty((rows.shape[0], shape[-1]), dtype=dtype)  # (R, IN)

    try:
        pieces = by_row_pieces(lambda start, stop: dequantize(rows[start:stop], kind), rows.shape[0], shape[-1] * 4)
        for start, stop, piece in pieces:  # float32 (stop - start, IN), rounded here
            values[start:stop] = torch.from_numpy(piece)
    except NotImplementedError:
        raise CheckpointError(f"{source}: tensor {tensor.name} has type {kind.name}, which gguf cannot dequantize") from None
    return values.reshape(shape)
