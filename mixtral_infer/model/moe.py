"""Mixture-of-experts feed-forward with top-k routing (top-2 in Mixtral).

Experts are stored stacked: ``w1, w3: (E, I, D)`` and ``w2: (E, D, I)``. Each token picks the k
experts with the largest gate logits; their outputs are mixed with a softmax over those k logits.
Tokens are grouped by expert so that each expert runs once, as one matmul over all of its tokens.

With expert parallelism a rank holds only the experts ``parallel.share(E)``; the routing still sees
all E experts, each rank adds what its own contribute, and an all-reduce sums the ranks' parts.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.model.parallel import Parallel


@dataclass
class MoeArgs:
    num_experts: int
    num_experts_per_tok: int


class MoeLayer(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, args: MoeArgs, parallel: Parallel = Parallel()):
        super().__init__()
        self.args = args
        self.parallel = parallel
        self.local_experts = parallel.share(args.num_experts)
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        n = len(self.local_experts)
        self.w1 = nn.Parameter(torch.empty(n, hidden_dim, dim))  # (E, I, D)
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden_dim))  # (E, D, I)
        self.w3 = nn.Parameter(torch.empty(n, hidden_dim, dim))  # (E, I, D)
        for weight in (self.w1, self.w2, self.w3):
            nn.init.normal_(weight, std=dim**-0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts ``(T, A)`` and their mixing weights ``(T, A)`` for x ``(T, D)``."""
        logits = self.gate(x)  # (T, E)
        top_logits, experts = torch.topk(logits, self.args.num_experts_per_tok, dim=-1)  # (T, A)
        weights = F.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
        return experts, weights

    def expert(self, e: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of this rank's e-th expert on x ``(N, D)`` (``e`` may be a 0-d tensor)."""
        hidden = F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e])  # (N, I)
        return F.linear(hidden, self.w2[e])  # (N, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, D)
        experts, weights = self.route(x)  # (T, A), (T, A)
        if x.shape[0] == 1:
            return self.parallel.all_reduce(self._one_token(x, experts[0], weights[0]))
        k = experts.shape[1]
        flat_experts = experts.flatten()  # (T*A,)
        order = torch.argsort(flat_experts, stable=True)  # assignments grouped by expert
        tokens = order // k  # (T*A,) the token of each sorted assignment
        mix = weights.flatten()[order, None]  # (T*A, 1)
        counts = torch.bincount(flat_experts, minlength=self.args.num_experts).tolist()
        out = torch.zeros_like(x)
        starts = [0, *accumulate(counts)]  # expert e's assignments are order[starts[e] : starts[e + 1]]
        rows, parts = [], []
        for local, e in enumerate(self.local_experts):
            count, start = counts[e], starts[e]
            if count == 0:
                continue
            chosen = tokens[start : start + count]
            rows.append(chosen)
            parts.append(self.expert(local, x[chosen]) * mix[start : start + count])
        if parts:
            # One accumulation for all experts (index_add_ runs as a slow scatter on CPU).
            out.index_put_((torch.cat(rows),), torch.cat(parts), accumulate=True)
        return self.parallel.all_reduce(out)

    def _one_token(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decoding at batch 1: run the token's k experts directly, no grouping. x: (1, D)."""
        out = torch.zeros_like(x)
        for e, weight in zip(experts.tolist(), weights):
            if e in self.local_experts:
                out += self.expert(e - self.local_experts.start, x) * weight
        return out
