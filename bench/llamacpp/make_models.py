"""Make the two benchmark models of the project checkout's bench/bench_vs_transformers.py as Hugging Face folders
and convert each to GGUF (F32, BF16, Q8_0) for llama.cpp.

Usage: python bench/llamacpp/make_models.py [--out $LLAMA_WORK/models] [--llama-cpp DIR] [--models mixtral-bench mistral-bench]
       [--types f32 bf16 q8_0 q4_0]   (q4_0 needs `cmake --build build --target llama-quantize` too)

Weights: the benchmark's own ``hf_model(bench_args(name))`` (seed 0: embeddings N(0,1), matrices
N(0, 1/fan_in), norms U(0.8, 1.2)), saved with ``save_pretrained`` in float32 (legacy per-expert
tensor names). Tokenizer: the shipped 2000-piece sentencepiece model of tiny-mixtral; the converter
pads the GGUF vocabulary to config.vocab_size = 32000 with [PADi] tokens (llama-bench feeds random
token ids). mixtral_infer loads {name}-hf-notok (links to the same files, no tokenizer.model).

A shape whose layers are not alike (``ministral-wide``: one full-attention layer, then three windowed)
is saved as transformers' MinistralForCausalLM, which this llama.cpp's converter refuses ("Architecture
'MinistralForCausalLM' not supported!"), and whose LLAMA architecture has no sliding window. Its GGUF
files are made from two folders of links to the same weights instead (``llama_folders``):
{name}-{type}.gguf from {name}-granite-hf, the same computation written as GraniteSWAForCausalLM
(llama.cpp's GRANITE_SWA: per-layer windows from ``layer_types``, an iSWA KV cache; Granite's
embedding, residual and logit multipliers 1, its attention multiplier 1/sqrt(head_dim), and attention
sinks of -1e30, which add exp(-1e30) = 0 to each softmax's denominator), and {name}-allfull-{type}.gguf from
{name}-mistral-hf, MistralForCausalLM (LLAMA: every layer full attention, as llama.cpp runs Mistral).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MAIN = Path(__file__).resolve().parents[2]  # the project checkout
QUANTIZE_ONLY = ("q4_0",)
sys.path.insert(0, str(MAIN / "bench"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("LLAMA_WORK", "/tmp/llama")) / "models")
    ap.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_WORK", "/tmp/llama")) / "llama_cpp_python-0.3.36/vendor/llama.cpp")
    ap.add_argument("--models", nargs="+", default=["mixtral-bench", "mistral-bench"])
    ap.add_argument("--types", nargs="+", default=["f32", "bf16", "q8_0", "q4_0"])
    a = ap.parse_args()
    import bench_vs_transformers as b

    for name in a.models:
        hf_dir = a.out / f"{name}-hf"
        if not (hf_dir / "config.json").is_file():
            hf = b.hf_model(b.bench_args(name, max_batch_size=1))
            hf.save_pretrained(hf_dir, safe_serialization=True)
            del hf
            shutil.copy(MAIN / "mixtral_infer/shipped/tiny-mixtral/tokenizer.model", hf_dir / "tokenizer.model")
        # mixtral_infer refuses a tokenizer.model whose size differs from vocab_size (and needs none to
        # load): it reads the same weights through a folder of links without the tokenizer.
        ours_dir = a.out / f"{name}-hf-notok"
        ours_dir.mkdir(exist_ok=True)
        for f in hf_dir.iterdir():
            if f.name != "tokenizer.model" and not (ours_dir / f.name).exists():
                (ours_dir / f.name).symlink_to(f.resolve())
        sources = llama_folders(hf_dir, a.out, name) if "layer_types" in json.loads((hf_dir / "config.json").read_text()) else {name: hf_dir}
        for gguf_name, source in sources.items():
            for t in a.types:
                gguf = a.out / f"{gguf_name}-{t}.gguf"
                if gguf.is_file():
                    continue
                if t in QUANTIZE_ONLY:  # the converter writes no Q4_0: llama-quantize makes it from the f32 file
                    cmd = [str(a.llama_cpp / "build/bin/llama-quantize"), str(a.out / f"{gguf_name}-f32.gguf"), str(gguf), t]
                    print(" ".join(cmd), flush=True)
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    continue
                env = {"PYTHONPATH": str(a.llama_cpp / "gguf-py"), "PATH": "/usr/bin:/bin"}
                cmd = [sys.executable, str(a.llama_cpp / "convert_hf_to_gguf.py"), str(source),
                       "--outtype", t, "--outfile", str(gguf)]
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    print("done:", *sorted(p.name for p in a.out.iterdir()))


def _linked(hf_dir: Path, folder: Path, config: dict) -> None:
    """``folder``: links to ``hf_dir``'s files but config.json, which is ``config``."""
    folder.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json") and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def llama_folders(hf_dir: Path, out: Path, name: str) -> dict:
    """For a MinistralForCausalLM folder (per-layer windows from ``layer_types``), the folders llama.cpp's
    converter reads with the same weights, by the GGUF name each gives (see the module's docstring)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((hf_dir / "config.json").read_text())
    index_file = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else None
    plain = {k: v for k, v in config.items() if k != "layer_types"}
    # Granite's multipliers: embeddings, residuals and logits by 1 (the converter writes 1.0 where the
    # config has none: transformers' GraniteConfig defaults), attention scores by 1/sqrt(head_dim) (its
    # default of 1.0 would replace llama.cpp's 1/sqrt(head_dim)); head_dim is dropped by Granite's
    # converter, which takes hidden_size / num_attention_heads (the same here).
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    granite = dict(plain, architectures=["GraniteSWAForCausalLM"], model_type="granite", attention_multiplier=config["head_dim"] ** -0.5,
                   embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0, layer_types=config["layer_types"])  # fmt: skip
    mistral = dict(plain, architectures=["MistralForCausalLM"], model_type="mistral")
    granite_dir, mistral_dir = out / f"{name}-granite-hf", out / f"{name}-mistral-hf"
    _linked(hf_dir, granite_dir, granite)
    _linked(hf_dir, mistral_dir, mistral)
    sinks = {f"model.layers.{i}.self_attn.sinks": torch.full((config["num_attention_heads"],), -1e30)
             for i in range(config["num_hidden_layers"])}
    save_file(sinks, granite_dir / "model-sinks.safetensors")
    for folder, extra in ((granite_dir, sinks), (mistral_dir, {})):
        if index is not None:
            weight_map = dict(index["weight_map"], **dict.fromkeys(extra, "model-sinks.safetensors"))
            (folder / index_file.name).write_text(json.dumps(dict(index, weight_map=weight_map), indent=1) + "\n")
    return {name: granite_dir, f"{name}-allfull": mistral_dir}


if __name__ == "__main__":
    main()
