"""Cutting one model across processes with torch.distributed (launched by torchrun).

Two ways, one at a time:

* **Pipeline** (``num_pipeline_ranks=N``): rank r holds a contiguous slice of the
  layers (rank 0 also the embeddings, the last rank the final norm and output),
  receives the hidden states from rank r-1 and sends its own to rank r+1. The last
  rank's logits are broadcast so every rank samples the same tokens.
* **Tensor / expert** (``tensor_parallel=N``): every rank holds every layer, with
  1/N of the query and KV heads, 1/N of the dense feed-forward's hidden units, or
  1/N of the experts. Each rank's partial output is summed with an all-reduce.

Each rank keeps only its share of the KV cache and reads only its share of the
weights: tensors of other ranks' layers or experts are skipped, row slices are
read as byte ranges, column slices are cut after reading the tensor.

Worked example, 4 layers, 8 query heads, 2 KV heads, 4 experts, N = 2::

    pipeline  rank 0: embeddings, layers 0-1        rank 1: layers 2-3, norm, output
    tensor    rank 0: heads 0-3, KV head 0, experts 0-1   rank 1: heads 4-7, KV head 1, experts 2-3
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixtral_infer.errors import ConfigError


@dataclass(frozen=True)
class Parallel:
    """This process's place in the group. ``Parallel()`` is the single-process model."""

    tensor_parallel: int = 1
    num_pipeline_ranks: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "num_pipeline_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.tensor_parallel > 1 and self.num_pipeline_ranks > 1:
            raise ConfigError("use either tensor_parallel or num_pipeline_ranks, not both")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.num_pipeline_ranks

    @property
    def is_first_stage(self) -> bool:
        return self.num_pipeline_ranks == 1 or self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.num_pipeline_ranks == 1 or self.rank == self.num_pipeline_ranks - 1

    def check(self, args) -> None:
        """Raise ConfigError, before any weight is read, when the model cannot be cut this way."""
        n = self.tensor_parallel
        if n > 1:
            for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("hidden_dim", args.hidden_dim)):
                if value % n:
                    raise ConfigError(f"tensor_parallel={n} does not divide {name}={value}")
            if args.moe is not None and args.moe.num_experts % n:
                raise ConfigError(f"tensor_parallel={n} does not divide moe.num_experts={args.moe.num_experts}")
        if self.num_pipeline_ranks > args.n_layers:
            raise ConfigError(f"num_pipeline_ranks={self.num_pipeline_ranks} exceeds n_layers={args.n_layers}")

    # ------------------------------------------------------------ shares

    def layer_range(self, n_layers: int) -> range:
        """Contiguous layers of this pipeline stage; earlier stages take one more when uneven."""
        if self.num_pipeline_ranks == 1:
            return range(n_layers)
        base, extra = divmod(n_layers, self.num_pipeline_ranks)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def share(self, n: int) -> range:
        """This rank's contiguous 1/N of n heads, hidden units or experts (all of them without tensor parallel)."""
        if self.tensor_parallel == 1:
            return range(n)
        size = n // self.tensor_parallel
        return range(self.rank * size, (self.rank + 1) * size)

    # ------------------------------------------------------------ communication

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial results of the tensor-parallel ranks (no-op in one process)."""
        if self.tensor_parallel > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x
