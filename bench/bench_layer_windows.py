"""What a per-layer cache saves: KV-cache bytes per sequence of Ministral 8B's shape, each layer's buffer
at its own size, beside one window for every layer and full attention everywhere.

Ministral 8B (params.json): 36 layers, 8 KV heads of 128, bfloat16, ``sliding_window`` repeating
``[full, 32768, 32768, 32768]`` (one full-attention layer in four). The bytes are the package's own:
``generation.settings.kv_cache_bytes`` (what ``load`` and ``serve`` size and refuse with), checked
against a cache actually made on the ``meta`` device (``RotatingBufferCache.nbytes``), which holds
no memory. ``one window`` is what a cache that knew one window for all layers would hold: it reads
the wrong keys in the full-attention layers, so it is the floor, not an option.

    .venv/bin/python bench/bench_layer_windows.py     # prints the table, writes bench/results_layer_windows.json
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mixtral_infer import ModelArgs
from mixtral_infer.generation.settings import kv_cache_bytes
from mixtral_infer.model.cache import RotatingBufferCache, layer_cache_sizes
from mixtral_infer.model.parallel import Parallel

WINDOW = 32768
MINISTRAL_8B = ModelArgs(
    dim=4096, n_layers=36, head_dim=128, hidden_dim=12288, n_heads=32, n_kv_heads=8, norm_eps=1e-5,
    vocab_size=131072, rope_theta=1e8, sliding_window=[None, WINDOW, WINDOW, WINDOW],
)  # fmt: skip
LENGTHS = [4096, 32768, 65536, 131072]
OUT = Path(__file__).with_name("results_layer_windows.json")


def sequence_bytes(args: ModelArgs, n_tokens: int) -> int:
    """One sequence of ``n_tokens`` tokens in bfloat16, as the package sizes it, checked against a cache made on ``meta``."""
    expected = kv_cache_bytes(args, 1, n_tokens, torch.bfloat16, Parallel())
    sizes = layer_cache_sizes(args.layer_windows, n_tokens)
    made = RotatingBufferCache(args.n_layers, 1, sizes, args.n_kv_heads, args.head_dim, args.layer_windows,
                               dtype=torch.bfloat16, device="meta")  # fmt: skip
    assert made.nbytes() == expected, (made.nbytes(), expected)
    return expected


def main() -> None:
    shapes = {
        "per layer (the package)": MINISTRAL_8B,
        "one window for all layers": dataclasses.replace(MINISTRAL_8B, sliding_window=WINDOW),
        "full attention everywhere": dataclasses.replace(MINISTRAL_8B, sliding_window=None),
    }
    rows = [{"tokens": n, **{name: sequence_bytes(args, n) for name, args in shapes.items()}} for n in LENGTHS]
    print(f"KV cache per sequence, Ministral 8B's shape (36 layers, 8 KV heads of 128, bfloat16, window {WINDOW} in 27 layers)")
    print(f"{'tokens':>8} " + " ".join(f"{name:>28}" for name in shapes) + "   saved vs full")
    for row in rows:
        per_layer, full = row["per layer (the package)"], row["full attention everywhere"]
        cells = " ".join(f"{row[name] / 2**30:>24.3f} GiB" for name in shapes)
        print(f"{row['tokens']:>8} {cells}   {1 - per_layer / full:>6.1%}")
    OUT.write_text(json.dumps({"model": "Ministral 8B shape", "dtype": "bfloat16", "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
