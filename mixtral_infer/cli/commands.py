"""The command line: ``demo`` and ``interactive``, parsed by fire.

Every function here only turns options into API calls and prints; errors of the
package are printed as one line (exit code 1), never as a traceback.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
import time
from typing import List, Optional

import torch

from mixtral_infer.checkpoint.loading import TOKENIZER_FILE, default_device, default_dtype, load_model, open_checkpoint
from mixtral_infer.errors import GenerationError, MixtralInferError
from mixtral_infer.generation.chat import Conversation
from mixtral_infer.generation.generate import DECODE_MODES, generate
from mixtral_infer.generation.settings import as_int, check_new_cache
from mixtral_infer.generation.settings import check_options as check_generation_options
from mixtral_infer.model.parallel import Parallel
from mixtral_infer.quant.model import model_scheme, quantized_numel
from mixtral_infer.quant.weights import QuantScheme
from mixtral_infer.shipped import DEFAULT_MODEL_NAME, SHIPPED_MODELS, resolve_model_folder, shipped_models
from mixtral_infer.tokenizer import Tokenizer, find_tokenizer

DEFAULT_MODEL = SHIPPED_MODELS / DEFAULT_MODEL_NAME
DEMO_PROMPTS = [
    "In the beginning",
    "And the LORD spake unto Moses, saying,",
    "Blessed are",
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if not isinstance(name, str) or name not in DTYPES:
        raise GenerationError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_decode(decode: str) -> None:
    if decode not in DECODE_MODES:
        raise GenerationError(f"--decode {decode!r} is not one of {', '.join(DECODE_MODES)}")


def parse_device(name: Optional[str]) -> torch.device:
    """The device a model can run on: cpu, cuda[:N] where CUDA is available, mps where MPS is."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name) if isinstance(name, str) else None
    except RuntimeError:
        device = None
    if device is None:
        raise GenerationError(f"--device {name!r} is not a torch device (try cpu or cuda)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GenerationError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GenerationError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise GenerationError(f"--device {name}: MPS is not available on this machine (use --device cpu)")
    elif device.type != "cpu":
        raise GenerationError(f"--device {name}: a model runs on cpu, cuda or mps, not {device.type}")
    return device


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
) -> None:
    """Every option of demo / interactive, checked before the model is loaded (fire passes strings as they came)."""
    check_generation_options(max_tokens, temperature, top_p, top_k, chunk_size, seed)
    for name, value in (("tensor_parallel", tensor_parallel), ("num_pipeline_ranks", num_pipeline_ranks)):
        if as_int(value) is None or as_int(value) < 1:
            raise GenerationError(f"--{name} {value!r} must be an integer >= 1")
    if device is not None:
        parse_device(device)
    parse_dtype(dtype)


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


def join_process_group(tensor_parallel: int, num_pipeline_ranks: int, device: Optional[str]):
    """(Parallel, device) for this process; joins the torchrun group when the model is cut."""
    import os

    parallel_size = tensor_parallel * num_pipeline_ranks
    if parallel_size == 1:
        return Parallel(), parse_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != parallel_size:
        raise MixtralInferError(
            f"--tensor_parallel {tensor_parallel} --num_pipeline_ranks {num_pipeline_ranks} needs {parallel_size} "
            f"processes; this is {world_size}: launch with torchrun --nproc-per-node {parallel_size} main.py ..."
        )
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    parallel = Parallel(tensor_parallel=tensor_parallel, num_pipeline_ranks=num_pipeline_ranks, rank=dist.get_rank())
    return parallel, torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")


def is_main_process() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def load(
    model_path: Optional[str],
    max_batch_size: int,
    device: Optional[str],
    dtype: Optional[str],
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    max_tokens: int = 0,
    quantize: Optional[str] = None,
):
    """(model, tokenizer) from a model folder or a shipped model's name; tiny-mixtral when none is given.

    Before any weight is read: the tokenizer must be there, and a model without a
    sliding window must have room for a cache of ``max_tokens`` new tokens.
    """
    folder = resolve_model_folder(str(model_path)) if model_path is not None else DEFAULT_MODEL
    parallel, torch_device = join_process_group(int(tensor_parallel), int(num_pipeline_ranks), device)
    torch_dtype = parse_dtype(dtype)
    tokenizer_path = find_tokenizer(folder)
    if folder.is_dir() and tokenizer_path is None:
        raise MixtralInferError(f"{folder / TOKENIZER_FILE}: file not found (the command line needs the model's tokenizer)")
    args = open_checkpoint(folder).args  # the configuration only
    cache_dtype = torch_dtype or (torch.bfloat16 if quantize else default_dtype(torch_device))
    check_new_cache(args, max_batch_size, int(max_tokens) + 1, int(max_tokens), cache_dtype, torch_device, parallel)
    start = time.perf_counter()
    model = load_model(
        folder,
        max_batch_size=max_batch_size,
        device=torch_device,
        dtype=torch_dtype,
        progress=ProgressBar("loading") if is_main_process() else None,
        parallel=parallel,
        quantize=quantize,
    )
    tokenizer = Tokenizer(tokenizer_path)
    n_params = sum(p.numel() for p in model.parameters()) + quantized_numel(model)
    scheme = model_scheme(model)
    print(
        f"rank {parallel.rank}: " if parallel.world_size > 1 else "",
        f"loaded {folder} ({n_params / 1e6:.1f}M parameters, {model.dtype}{', weights ' + scheme.label if scheme else ''}, {model.device}) "
        f"in {time.perf_counter() - start:.2f}s",
        sep="",
        file=sys.stderr,
    )
    return model, tokenizer


def demo(
    model_path: Optional[str] = None,
    max_tokens: int = 60,
    temperature: float = 0.7,
    top_p: float = 0.9,
    top_k: Optional[int] = None,
    chunk_size: Optional[int] = None,
    seed: Optional[int] = 0,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    decode: str = "auto",
    quantize: Optional[str] = None,
) -> None:
    """Complete three prompts of different lengths in one batch and print them.

    MODEL_PATH: a model folder or a shipped model's name (see `models`); default tiny-mixtral.

    Sampled (temperature 0.7, top-p 0.9) with a fixed seed, so the output is the same every run;
    --temperature 0 for greedy.

    Under torchrun, --tensor_parallel N or --num_pipeline_ranks N cut the model across the N processes.
    --decode eager|static|compiled|auto: auto compiles the decode step on CUDA (eager on CPU).
    --quantize int8|int4|int4-128: weight-only quantization while loading (bfloat16 compute unless --dtype).
    """
    check_decode(decode)
    check_options(max_tokens, temperature, top_p, top_k, chunk_size, seed, device, dtype, tensor_parallel, num_pipeline_ranks)
    QuantScheme.parse(quantize)
    model, tokenizer = load(model_path, len(DEMO_PROMPTS), device, dtype, tensor_parallel, num_pipeline_ranks, max_tokens, quantize)
    encoded = [tokenizer.encode(prompt, bos=True) for prompt in DEMO_PROMPTS]
    start = time.perf_counter()
    generated, _ = generate(
        encoded,
        model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        chunk_size=chunk_size,
        eos_id=tokenizer.eos_id,
        seed=seed,
        prompt_logprobs=False,
        decode=decode,
    )
    elapsed = time.perf_counter() - start
    if not is_main_process():
        return
    for prompt, tokens in zip(DEMO_PROMPTS, generated):
        print(f"{prompt}{_continuation(tokenizer, tokens)}")
        print("-" * 40)
    n_tokens = sum(len(t) for t in generated)
    print(f"{n_tokens} tokens in {elapsed:.2f}s ({n_tokens / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)


def _continuation(tokenizer: Tokenizer, tokens: List[int]) -> str:
    """Decoded new tokens, with the space that sentencepiece drops at the start of a decode."""
    text = tokenizer.decode(tokens)
    if tokens and tokenizer.id_to_piece(tokens[0]).startswith("\u2581"):
        text = " " + text
    return text


def interactive(
    model_path: Optional[str] = None,
    instruct: bool = False,
    max_tokens: int = 100,
    temperature: float = 0.7,
    top_p: float = 0.9,
    top_k: Optional[int] = None,
    chunk_size: Optional[int] = None,
    seed: Optional[int] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    tensor_parallel: int = 1,
    num_pipeline_ranks: int = 1,
    decode: str = "auto",
    quantize: Optional[str] = None,
) -> None:
    """A prompt loop that streams each answer; /reset starts over, /quit (or end of input) leaves.

    With --instruct, turns are wrapped in [INST] ... [/INST] and later turns see earlier ones.
    Under torchrun, rank 0 reads the input and shares each line with the other ranks.
    --decode eager|static|compiled|auto: auto compiles the decode step on CUDA (eager on CPU).
    --quantize int8|int4|int4-128: weight-only quantization while loading (bfloat16 compute unless --dtype).
    """
    check_decode(decode)
    QuantScheme.parse(quantize)
    if not isinstance(instruct, bool):
        raise GenerationError(f"--instruct takes no value (got {instruct!r}): write --instruct or --noinstruct")
    check_options(max_tokens, temperature, top_p, top_k, chunk_size, seed, device, dtype, tensor_parallel, num_pipeline_ranks)
    model, tokenizer = load(model_path, 1, device, dtype, tensor_parallel, num_pipeline_ranks, max_tokens, quantize)
    main_process = is_main_process()
    conversation = Conversation(
        model,
        tokenizer,
        instruct=instruct,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        chunk_size=chunk_size,
        seed=seed,
        decode=decode,
    )
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # undecodable bytes become U+FFFD, not a crash
    if main_process:
        print("type a prompt; /reset starts a new conversation, /quit leaves", file=sys.stderr)
    while True:
        line = _read_line() if main_process else None
        line = _share_line(line)
        if line is None:
            return
        if line.startswith("/"):
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
            conversation.reply(line, emit=emit)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        if main_process:
            print(flush=True)


def _read_line() -> Optional[str]:
    """The next input line, or None at end of input or Ctrl-C."""
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None


def _share_line(line: Optional[str]) -> Optional[str]:
    """Rank 0's line, on every rank of a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return line
    shared = [line]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def convert(
    src: str, dst: str, to: Optional[str] = None, dtype: Optional[str] = None, max_shard_size: str = "5GB",
    quantize: Optional[str] = None,
) -> None:  # fmt: skip
    """Write the model folder SRC to the new folder DST in the other layout (--to mistral|hf).

    A Hugging Face folder is written in shards of at most --max_shard_size (5GB, 500MB, ...),
    with the tokenizer files transformers reads. --quantize int8|int4|int4-128 writes a
    quantized Mistral folder (integers and scales) that loads without quantizing again.
    """
    from mixtral_infer.checkpoint.convert import convert as convert_folder

    start = time.perf_counter()
    written = convert_folder(
        str(src), str(dst), to=to, dtype=parse_dtype(dtype), max_shard_size=str(max_shard_size),
        notify=lambda message: print(message, file=sys.stderr), quantize=quantize,
    )
    print(f"wrote {written} in {time.perf_counter() - start:.2f}s", file=sys.stderr)


def models() -> None:
    """List the models shipped with the package; their names work wherever MODEL_PATH is asked for."""
    from mixtral_infer.checkpoint.loading import read_params

    for name, folder in shipped_models().items():
        args = read_params(folder)
        kind = f"{args.moe.num_experts} experts top-{args.moe.num_experts_per_tok}" if args.moe is not None else "dense"
        default = " (default)" if name == DEFAULT_MODEL_NAME else ""
        print(f"{name}{default}: dim {args.dim}, {args.n_layers} layers, {kind}, window {args.sliding_window}  {folder}")


COMMANDS = {"demo": demo, "interactive": interactive, "convert": convert, "models": models}


def check_arguments(argv: List[str]) -> None:
    """Refuse unknown options and surplus arguments before fire runs anything.

    fire calls the command with the arguments it recognises and only complains about
    the others after the call returns: ``demo --max_token 5`` would run the whole
    default demo first. The rules are fire's: ``--name value``, ``--name=value``,
    ``--flag`` / ``--noflag`` for booleans, ``-`` and ``_`` alike; ``--`` ends the options.
    """
    if not argv or argv[0] not in COMMANDS or any(a in ("-h", "--help") for a in argv):
        return  # fire's own usage message
    command, args = argv[0], list(argv[1:])
    if "--" in args:
        args = args[: args.index("--")]
    names = list(inspect.signature(COMMANDS[command]).parameters)
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
            raise MixtralInferError(
                f"{command}: unknown option {arg.split('=', 1)[0]}; {hint}options: {', '.join('--' + n for n in names)}"
            )
        given.add(name)
        skip = "=" not in arg and not is_flag
    free = [n for n in names if n not in given]
    if len(positional) > len(free):
        raise MixtralInferError(f"{command}: unexpected argument {positional[len(free)]!r} (takes {', '.join(free) or 'none'})")


def main(argv: Optional[List[str]] = None) -> int:
    import fire

    from mixtral_infer import __version__

    if (sys.argv[1:] if argv is None else argv) in (["--version"], ["-V"]):
        print(f"mixtral-infer {__version__}")
        return 0
    try:
        check_arguments(list(sys.argv[1:] if argv is None else argv))
        fire.Fire(COMMANDS, command=argv, name="mixtral-infer")
    except MixtralInferError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
