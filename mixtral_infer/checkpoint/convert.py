"""Converting a model folder between the Mistral layout and Hugging Face's.

Tensors stream from the source to the destination: one at a time into a Mistral
``consolidated.safetensors``, one shard of at most ``max_shard_size`` at a time into
Hugging Face shards (``safetensors_writer``), every byte written once. The files are laid
out before any tensor is read, from the source's headers (``planned_tensors``). A Hugging
Face folder also gets what transformers' ``AutoTokenizer`` reads (``hf_tokenizer``:
``tokenizer.json`` and its configuration, written from a sentencepiece model or a tekken file);
a Mistral folder gets the source's ``tokenizer.model`` or ``tekken.json``, or its
``tokenizer.json`` and configuration when that is all it has. Everything is written into a
hidden sibling folder ``.DST.partial-PID`` that is renamed to the destination only once
complete, so an interrupted conversion leaves no half-written checkpoint behind; the next
conversion to the same destination removes what a killed one left. The destination must
not exist: nothing is ever overwritten.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from safetensors import SafetensorError

from mixtral_infer.checkpoint.hf_format import hf_config_from_args, hf_to_published, published_to_hf
from mixtral_infer.checkpoint.hf_tokenizer import write_hf_tekken_tokenizer, write_hf_tokenizer
from mixtral_infer.checkpoint.loading import (
    Progress,
    HF_CONFIG_FILE,
    PARAMS_FILE,
    SAFETENSORS_FILE,
    TOKENIZER_FILE,
    Checkpoint,
    _pth_tensors,
    check_finite,
    open_checkpoint,
)
from mixtral_infer.checkpoint.params import args_to_params
from mixtral_infer.checkpoint.lora import merged, open_adapter
from mixtral_infer.checkpoint.quantized import PARAMS_KEY, recorded, to_stored
from mixtral_infer.checkpoint.safetensors_reader import read_header
from mixtral_infer.checkpoint.safetensors_writer import (
    DEFAULT_MAX_SHARD_SIZE,
    parse_size,
    write_hf_shards,
    write_safetensors,
)
from mixtral_infer.errors import CheckpointError
from mixtral_infer.quant.model import check_quantizable
from mixtral_infer.quant.weights import QuantScheme
from mixtral_infer.tokenizer import ADDED_TOKEN_FILES, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, Tokenizer, find_tokenizer
from mixtral_infer.tokenizer.gguf_vocab import sentencepiece_proto

FORMATS = ("mistral", "hf")


def convert(
    src: str | Path,
    dst: str | Path,
    to: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    notify: Callable[[str], None] = lambda message: None,
    progress: Optional[Progress] = None,
    quantize: Optional[str] = None,
    lora: Optional[str | Path] = None,
    lora_scale: float = 1.0,
) -> Path:
    """Write ``src`` to the new folder ``dst`` in format ``to`` (default: the other one).

    ``dst`` must not exist: a conversion never overwrites. The files are written into
    ``.DST.partial-PID`` beside it and renamed to ``dst`` once complete. A partial
    folder of a conversion that was killed is removed, and ``notify`` says so.
    ``progress(done, total)`` is called as each tensor is read (the command line's bar).

    ``max_shard_size`` (bytes, or "5GB", "500MB"): the largest Hugging Face shard.
    ``quantize`` ("int8", "w8a8", "int4", "int4-128", "nf4"): write a quantized Mistral folder (integers
    and scales, ``checkpoint/quantized.py``) that loads without quantizing again.
    ``lora``: a LoRA adapter merged into the weights written (``checkpoint/lora.py``), times ``lora_scale``.
    """
    scheme = QuantScheme.parse(quantize)
    checkpoint = open_checkpoint(src)
    parse_size(max_shard_size)  # a bad size is an error before anything is written
    target = to or ("hf" if checkpoint.format == "mistral" and scheme is None else "mistral")
    if target not in FORMATS:
        raise CheckpointError(f"--to {target!r}: expected one of {', '.join(FORMATS)}")
    if checkpoint.quantization is not None:
        raise CheckpointError(f"{checkpoint.folder}: its weights are quantized as {checkpoint.quantization.label}; convert the float original instead")
    if checkpoint.bitsandbytes is not None:
        raise CheckpointError(
            f"{checkpoint.folder}: its weights are bitsandbytes' 4-bit nf4, which load as they are; "
            "convert the float original instead"
        )
    if scheme is not None and target != "mistral":
        raise CheckpointError("--quantize writes the Mistral layout (transformers cannot read these integers): use --to mistral")
    if scheme is not None:
        check_quantizable(checkpoint.args, scheme)  # before anything is written
    adapter = open_adapter(lora, checkpoint.args, lora_scale) if lora is not None else None  # checked before anything is written
    tokenizer = find_tokenizer(checkpoint.folder)
    read = None if tokenizer is None else Tokenizer(tokenizer)  # refused (no BOS, say) before anything is written
    dst = Path(dst)
    check_destination(dst)
    remove_stale_partials(dst, notify)

    partial = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    try:
        partial.mkdir()
    except OSError as error:
        raise CheckpointError(f"{dst.parent}: cannot write here ({error.strerror})") from None
    try:
        tensors = checkpoint.published_tensors(progress)
        if adapter is not None:
            tensors = merged(tensors, adapter, dtype)
        tensors = finite(tensors, dtype, str(checkpoint.folder))
        params = args_to_params(checkpoint.args)
        plan = planned_tensors(checkpoint, target, dtype)
        if scheme is not None:
            tensors = to_stored(tensors, scheme)
            plan = list(to_stored(iter(plan), scheme))
            params[PARAMS_KEY] = scheme.to_params()
        if target == "mistral":
            metadata = None if scheme is None else recorded(scheme)  # params.json's scheme, checked when loaded
            write_safetensors(partial / SAFETENSORS_FILE, tensors, metadata=metadata, plan=plan)
            (partial / PARAMS_FILE).write_text(json.dumps(params, indent=2) + "\n", encoding="utf-8")
        else:
            hf_tensors = published_to_hf(tensors, checkpoint.args)
            shards = write_hf_shards(partial, hf_tensors, max_shard_size, metadata={"format": "pt"}, plan=plan)
            written_dtype = dtype or _first_dtype(shards[0])
            config = hf_config_from_args(checkpoint.args, written_dtype)
            (partial / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None and checkpoint.gguf is not None:  # its vocabulary, written as a tokenizer.model
            (partial / TOKENIZER_FILE).write_bytes(sentencepiece_proto(tokenizer))
            tokenizer = partial / TOKENIZER_FILE
        elif tokenizer is not None:  # read with a fine-tune's added tokens and end token, from the files beside it
            shutil.copyfile(tokenizer, partial / tokenizer.name)
        if tokenizer is not None:
            if read.kind == "tekken":  # Mistral's layout reads tekken.json; transformers' fast tokenizer tokenizer.json
                if target == "hf":
                    write_hf_tekken_tokenizer(read.file, partial)
            elif read.kind == "tokenizer.json":  # BOS and EOS were read from the files beside it
                for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
                    if (checkpoint.folder / name).is_file():
                        shutil.copyfile(checkpoint.folder / name, partial / name)
            elif target == "hf":
                if tokenizer.name != TOKENIZER_FILE:  # transformers' LlamaTokenizer reads tokenizer.model
                    shutil.copyfile(tokenizer, partial / TOKENIZER_FILE)
                write_hf_tokenizer(tokenizer, partial, list(read.added.values()), read.id_to_piece(read.eos_id))
            elif read.added:  # the files they were read from travel beside tokenizer.model
                for name in (*ADDED_TOKEN_FILES, SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
                    if (checkpoint.folder / name).is_file():
                        shutil.copyfile(checkpoint.folder / name, partial / name)
        os.rename(partial, dst)
    except (OSError, SafetensorError) as error:  # a full disk: safetensors' writer raises its own error
        shutil.rmtree(partial, ignore_errors=True)
        why = error.strerror if isinstance(error, OSError) else str(error).rpartition(": ")[2]
        raise CheckpointError(f"{dst}: cannot write ({why}); nothing was written to {dst}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dst


def finite(tensors: Iterator[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype], source: str) -> Iterator:
    """Each tensor in ``dtype`` (None: as stored), refused by name where it holds NaN or inf (a
    damaged checkpoint, not written on) or passes ``dtype``'s range (float16's 65504: written as inf
    it would not load), before it is written."""
    for name, tensor in tensors:
        placed = tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
        if placed.is_floating_point():
            check_finite(name, tensor, placed, source, remedy="convert with --dtype bfloat16 or float32")
        yield name, placed


def check_destination(dst: Path) -> None:
    """``dst`` must be a new name (not even a dangling symlink) in a writable folder, short enough
    for the partial folder ``.DST.partial-PID`` written first."""
    partial_name = os.fsencode(f".{dst.name}.partial-{os.getpid()}")
    try:
        limit = os.pathconf(dst.parent, "PC_NAME_MAX")
    except OSError:  # no such folder (said below), or a file system that does not say
        limit = 255
    if len(partial_name) > limit:
        shown = dst.name if len(dst.name) <= 40 else dst.name[:37] + "..."
        raise CheckpointError(f"{shown}: name too long (the partial folder .NAME.partial-PID written first needs "
                              f"{len(partial_name) - limit} fewer bytes); choose a shorter destination")  # fmt: skip
    if dst.is_symlink() or dst.exists():
        kind = "a symlink" if dst.is_symlink() else "a folder" if dst.is_dir() else "a file"
        raise CheckpointError(f"{dst}: already exists ({kind}); choose a new destination folder")
    if not dst.parent.is_dir():
        raise CheckpointError(f"{dst.parent}: folder not found")
    if not os.access(dst.parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{dst.parent}: cannot write here (permission denied)")


def remove_stale_partials(dst: Path, notify: Callable[[str], None]) -> None:
    """Remove ``.DST.partial-PID`` folders whose process is gone; refuse while one is still running."""
    for partial in sorted(dst.parent.glob(f".{glob.escape(dst.name)}.partial-*")):
        pid_text = partial.name.rsplit("-", 1)[1]
        if not pid_text.isdigit() or partial.is_symlink() or not partial.is_dir():
            continue  # not one of ours
        pid = int(pid_text)
        if pid != os.getpid() and _process_alive(pid):
            raise CheckpointError(
                f"{partial}: another conversion to {dst} (process {pid}) is running; wait for it, "
                "or remove this folder if no conversion is running"
            )
        shutil.rmtree(partial)
        notify(f"removed {partial}, left by an interrupted conversion (process {pid} is gone)")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


def _first_dtype(path: Path) -> torch.dtype:
    return read_header(path)[0].dtype


def planned_tensors(checkpoint: Checkpoint, target: str, dtype: Optional[torch.dtype] = None) -> List[Tuple[str, torch.Tensor]]:
    """What ``convert`` writes in format ``target``, in order, as tensors on the meta device: the writers' plan.

    Worked out from the source's headers alone (the meta tensors go through the same
    translation as the real ones), so the files can be laid out before any tensor is read.
    """

    def shapes() -> Iterator[Tuple[str, torch.Tensor]]:
        for path in checkpoint.weight_files:
            if path.suffix == ".safetensors":
                entries = sorted(read_header(path), key=lambda e: e.begin)  # the order iter_tensors reads them in
                pairs = ((e.name, e.shape, e.dtype) for e in entries)
            else:  # memory-mapped: nothing is read
                pairs = ((name, tuple(t.shape), t.dtype) for name, t in _pth_tensors(path))
            for name, shape, stored in pairs:
                yield name, torch.empty(shape, dtype=dtype or stored, device="meta")

    published = hf_to_published(shapes(), checkpoint.args) if checkpoint.format == "hf" else shapes()
    if checkpoint.gguf is not None:
        published = checkpoint.gguf.planned(dtype)
    return list(published_to_hf(published, checkpoint.args) if target == "hf" else published)
