"""Make the two benchmark models of the project checkout's bench/bench_vs_transformers.py as Hugging Face folders
and convert each to GGUF (F32, BF16, Q8_0) for llama.cpp.

Usage: python bench/llamacpp/make_models.py [--out $LLAMA_WORK/models] [--llama-cpp DIR] [--models mixtral-bench mistral-bench]
       [--types f32 bf16 q8_0 q4_0]   (q4_0 needs `cmake --build build --target llama-quantize` too)

Weights: the benchmark's own ``hf_model(bench_args(name))`` (seed 0: embeddings N(0,1), matrices
N(0, 1/fan_in), norms U(0.8, 1.2)), saved with ``save_pretrained`` in float32 (legacy per-expert
tensor names). Tokenizer: the shipped 2000-piece sentencepiece model of tiny-mixtral; the converter
pads the GGUF vocabulary to config.vocab_size = 32000 with [PADi] tokens (llama-bench feeds random
token ids). mixtral_infer loads {name}-hf-notok (links to the same files, no tokenizer.model).
"""
import argparse
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
        for t in a.types:
            gguf = a.out / f"{name}-{t}.gguf"
            if gguf.is_file():
                continue
            if t in QUANTIZE_ONLY:  # the converter writes no Q4_0: llama-quantize makes it from the f32 file
                cmd = [str(a.llama_cpp / "build/bin/llama-quantize"), str(a.out / f"{name}-f32.gguf"), str(gguf), t]
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                continue
            env = {"PYTHONPATH": str(a.llama_cpp / "gguf-py"), "PATH": "/usr/bin:/bin"}
            cmd = [sys.executable, str(a.llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir),
                   "--outtype", t, "--outfile", str(gguf)]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    print("done:", *sorted(p.name for p in a.out.iterdir()))


if __name__ == "__main__":
    main()
