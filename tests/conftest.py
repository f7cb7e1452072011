"""Shared fixtures: tiny random models, ours and Hugging Face transformers' on the same weights."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
import warnings

import pytest
import torch

# Nothing measures the machine in the tests (fast.measured): load_model gives Tuning()'s defaults,
# in this process and the ones it starts. Tests that want other choices pass a Tuning.
os.environ["MIXTRAL_INFER_MEASURE"] = "0"
os.environ["MIXTRAL_INFER_BACKGROUND_COMPILE"] = "0"  # decode="auto" on CPU stays eager: no build per generate()
# Without a GPU, Triton's kernels (fast.triton_experts) run under its interpreter, on CPU tensors:
# set before Triton is first imported, which reads it when a kernel is defined.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

from mixtral_infer import ModelArgs, MoeArgs, Transformer
from mixtral_infer.checkpoint.hf_format import hf_config_from_args, hf_to_published
from mixtral_infer.checkpoint.loading import build_model, save_consolidated
from mixtral_infer.fast.cpu_packed import onednn_packs
from mixtral_infer.kernels import native

WINDOW = 8
# The float type the packed-weight tests pack: bfloat16 where this CPU's oneDNN reorders it (AVX-512:
# what load_model packs), else float32, which oneDNN packs on every x86 CPU (fast.cpu_packed).
PACKS = torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32


NATIVE_REASON = native.unavailable_because()  # why the package's C++ kernels cannot be built here, or None


@pytest.fixture
def loaded_kernels():
    """The native operators loaded in this process (built or read from the cache), the integer ones'
    fake implementations registered: a test that calls them directly may run first in its worker."""
    from mixtral_infer.kernels.linear.int_dots import available

    assert available(), f"the native kernels did not load: {native._STATE.get('why')}"


def needs_kernels(test):
    """Skipped where the native kernels cannot be built (``native.unavailable_because``), else run with
    them loaded."""
    test = pytest.mark.usefixtures("loaded_kernels")(test)
    return pytest.mark.skipif(NATIVE_REASON is not None, reason=f"the native kernels cannot be built here: {NATIVE_REASON}")(test)


def eager_and_compiled_decode(model, tuning):
    """One decode step of 2 rows through ``decode_logits``, eager and torch.compile'd under ``tuning``
    with every layer written out (``regions=False``): ``(eager logits, compiled logits, the code)``."""
    from torch._inductor.utils import run_and_get_code

    from mixtral_infer.steps.decode_step import decode_logits

    written_out = dataclasses.replace(tuning, regions=False)  # every layer's calls in the code
    cache = model.make_cache(2)
    cache.start_sequences(2)
    inputs = (torch.tensor([5, 6]), torch.tensor([3, 9]), torch.ones(2, dtype=torch.bool))
    torch._dynamo.reset()
    with torch.inference_mode():
        expected = decode_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
        compiled = torch.compile(lambda k, v, *a: decode_logits(model, k, v, *a, tuning=written_out), fullgraph=True, dynamic=False)
        got, codes = run_and_get_code(compiled, cache.cache_k.clone(), cache.cache_v.clone(), *inputs)
    return expected, got, codes


def tiny_args(moe: bool = True, sliding_window: int | None | list = WINDOW, max_batch_size: int = 4) -> ModelArgs:
    """2 layers, GQA ratio 2, head_dim 16; MoE with 4 experts, top-2."""
    return ModelArgs(
        dim=64,
        n_layers=2,
        head_dim=16,
        hidden_dim=96,
        n_heads=4,
        n_kv_heads=2,
        norm_eps=1e-5,
        vocab_size=128,
        max_batch_size=max_batch_size,
        sliding_window=sliding_window,
        moe=MoeArgs(num_experts=4, num_experts_per_tok=2) if moe else None,
    )


def random_model(args: ModelArgs, seed: int = 0, fast: bool = True) -> Transformer:
    """Our model with random weights large enough that logits are far from uniform, with the fast
    modules swapped in as ``load_model`` does (``fast=False``: the reference modules)."""
    from mixtral_infer.formats.modules import use_formats
    from mixtral_infer.tuning import Tuning

    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.15)
    return use_formats(model, Tuning(fast=fast)).eval()


def hf_config(args: ModelArgs):
    """transformers' config for the same shapes (through the package's own config.json writer)."""
    import transformers

    config = hf_config_from_args(args, torch.float32)
    config.update(initializer_range=0.15, max_position_embeddings=4096)
    config.pop("architectures"), config.pop("torch_dtype")
    classes = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM),  # per-layer windows
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_class, model_class = classes[config.pop("model_type")]
    return config_class(**config), model_class


def hf_model(args: ModelArgs, seed: int = 0):
    """A transformers model with random float32 weights."""
    config, model_class = hf_config(args)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.uniform_(0.8, 1.2)
    return model.float().eval()


def ours_from_hf(hf, args: ModelArgs) -> Transformer:
    tensors = hf_to_published(hf.state_dict().items(), args)
    return build_model(args, tensors, "transformers", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session", params=["mistral", "mixtral"])
def model_pair(request):
    """(ours, transformers', args) on the same random weights."""
    args = tiny_args(moe=request.param == "mixtral")
    hf = hf_model(args)
    return ours_from_hf(hf, args), hf, args


MINISTRAL_WINDOWS = [None, WINDOW, WINDOW, WINDOW]  # Ministral 8B's pattern: one full-attention layer, three windowed


def ministral_args(max_batch_size: int = 4) -> ModelArgs:
    """``tiny_args`` with 4 dense layers in Ministral's pattern of windows (``MINISTRAL_WINDOWS``)."""
    return dataclasses.replace(tiny_args(moe=False, max_batch_size=max_batch_size), n_layers=4, sliding_window=list(MINISTRAL_WINDOWS))


@pytest.fixture(scope="session")
def ministral_pair():
    """(ours, transformers' MinistralForCausalLM, args) on the same random weights."""
    args = ministral_args()
    hf = hf_model(args)
    return ours_from_hf(hf, args), hf, args


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    """A small sentencepiece model (byte fallback, Mistral's special ids) trained on torch's docstrings."""
    import inspect

    import sentencepiece as spm
    import torch.nn.modules.module as text_source

    lines = [line.strip() for line in inspect.getsource(text_source).splitlines() if line.strip()]
    prefix = tmp_path_factory.mktemp("tokenizer") / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=400, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture()
def model_folder(tmp_path, tokenizer_path):
    """A complete Mistral-format folder: params.json, consolidated.safetensors, tokenizer.model (vocab 400)."""
    import dataclasses
    import shutil

    from mixtral_infer.checkpoint.loading import save_consolidated

    args = dataclasses.replace(tiny_args(moe=True), vocab_size=400)
    folder = tmp_path / "model"
    save_consolidated(random_model(args, seed=5), folder)
    shutil.copyfile(tokenizer_path, folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests, restored after: tiny models run faster on one
    thread, and far faster when the machine's other core is busy (serve tests: up to 20x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def wait_for(condition, timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def generated_loops(codes) -> list:
    """The outermost loops of the C++ kernels in inductor's generated ``codes`` (from
    ``run_and_get_code``), each as the text from its ``for(int64_t x0=`` up to the next or the kernel's end."""
    kernels = [body for code in codes for body in re.findall(r'extern "C"(.*?)\'\'\'', code, flags=re.S)]
    return [loop for body in kernels for loop in body.split("for(int64_t x0=")[1:]]


@pytest.fixture(scope="session")
def v3_tokenizer_path(tmp_path_factory):
    """A v3-style tokenizer: Mistral's ids 0-2, then [INST]/[/INST] as control pieces 3-4, a user-defined
    piece, identity normalization, byte fallback (as tokenizer.model.v3 of Mistral 7B v0.3)."""
    import inspect

    import sentencepiece as spm
    import torch.nn.modules.module as text_source

    lines = [line.strip() for line in inspect.getsource(text_source).splitlines() if line.strip()]
    prefix = tmp_path_factory.mktemp("v3") / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=420, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, minloglevel=2,
        control_symbols=["[INST]", "[/INST]"], user_defined_symbols=["<tool>"], normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="session")
def v3_folder(tmp_path_factory, v3_tokenizer_path):
    """A Mistral folder that ships only tokenizer.model.v3, like Mistral 7B v0.3's."""
    folder = tmp_path_factory.mktemp("v3-model") / "model"
    save_consolidated(random_model(dataclasses.replace(tiny_args(moe=False), vocab_size=420), seed=7), folder)
    shutil.copyfile(v3_tokenizer_path, folder / "tokenizer.model.v3")
    return folder
