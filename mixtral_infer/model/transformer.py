"""The Mistral / Mixtral decoder: GQA attention with rotary embeddings, RMSNorm, SwiGLU (dense)
or mixture-of-experts feed-forward. The batch is one flat tensor of ``sum(seqlens)`` tokens with
the list of sequence lengths, so ragged batches need no padding.

Shape legend, one meaning per letter across the package: T tokens in the flat batch, B sequences,
D model dim, H query heads, H_kv KV heads, Dh head dim, S cache slots per sequence, L layers,
I feed-forward hidden dim, E experts, A experts chosen per token (top-k), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.errors import GenerationError, as_int
from mixtral_infer.model.attention import attention
from mixtral_infer.model.cache import CacheView, RotatingBufferCache, causal_attention_bias, layer_cache_sizes
from mixtral_infer.model.moe import MoeArgs, MoeLayer
from mixtral_infer.model.parallel import Parallel
from mixtral_infer.model.rope import apply_rotary, rotary_angles


@dataclass
class ModelArgs:
    """A model's shape, as in ``params.json``, plus the batch it serves. Read from files and checked
    by ``checkpoint.params``."""

    dim: int
    n_layers: int
    head_dim: int
    hidden_dim: int
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    vocab_size: int
    max_batch_size: int = 1  # not the model's: the batch a loaded model serves (never written to params.json)
    # When absent: 10000.0 with a sliding window, 1e6 without (as the published models do).
    rope_theta: Optional[float] = None
    # One window for every layer, None (full attention everywhere), or a list repeated over the
    # layers, None in it for a full-attention layer (params.json's form, as mistral-inference reads
    # it): Ministral 8B's ``[None, W, W, W]`` is one full-attention layer, then three windowed ones.
    sliding_window: Union[None, int, List[Optional[int]]] = None
    moe: Optional[MoeArgs] = None

    def __post_init__(self) -> None:
        if self.rope_theta is None:
            self.rope_theta = 10000.0 if self.sliding_window is not None else 1e6

    @property
    def layer_windows(self) -> List[Optional[int]]:
        """Each layer's window, None for full attention: ``sliding_window`` repeated over the layers.

        >>> ModelArgs(8, 8, 4, 16, 2, 1, 1e-5, 10, sliding_window=[None, 3, 3, 3]).layer_windows
        [None, 3, 3, 3, None, 3, 3, 3]
        """
        pattern = self.sliding_window if isinstance(self.sliding_window, list) else [self.sliding_window]
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    @property
    def full_attention(self) -> bool:
        """Some layer attends to every earlier position: its cache grows with the sequence, so a
        cache must be sized for the longest sequence (``max_seqlen``)."""
        return any(window is None for window in self.layer_windows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x / sqrt(mean(x^2) + eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Grouped-query attention; with tensor parallelism, this rank's share of the heads."""

    def __init__(self, args: ModelArgs, parallel: Parallel = Parallel()):
        super().__init__()
        self.parallel = parallel
        self.n_heads = len(parallel.share(args.n_heads))
        self.n_kv_heads = len(parallel.share(args.n_kv_heads))
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * args.head_dim, args.dim, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections of x ``(T, D)``: ``(T, H*Dh)``, ``(T, H_kv*Dh)``, ``(T, H_kv*Dh)``."""
        return self.wq(x), self.wk(x), self.wv(x)

    def project(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(T, H, Dh)``, keys and values ``(T, H_kv, Dh)`` of x ``(T, D)``, q and k rotated."""
        n_tokens = x.shape[0]
        xq, xk, xv = self.qkv(x)
        xq = xq.reshape(n_tokens, self.n_heads, self.head_dim)  # (T, H, Dh)
        xk = xk.reshape(n_tokens, self.n_kv_heads, self.head_dim)  # (T, H_kv, Dh)
        xv = xv.reshape(n_tokens, self.n_kv_heads, self.head_dim)  # (T, H_kv, Dh)
        return apply_rotary(xq, *rotary), apply_rotary(xk, *rotary), xv

    def forward(
        self,
        x: torch.Tensor,  # (T, D)
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: Optional[CacheView],
        mask,
    ) -> torch.Tensor:
        n_tokens = x.shape[0]
        xq, xk, xv = self.project(x, rotary)
        out = self.attend(xq, xk, xv, cache, mask)  # (T, H, Dh)
        out = self.wo(out.reshape(n_tokens, self.n_heads * self.head_dim))  # (T, D)
        return self.parallel.all_reduce(out)

    def attend(
        self,
        xq: torch.Tensor,  # (T, H, Dh)
        xk: torch.Tensor,  # (T, H_kv, Dh)
        xv: torch.Tensor,
        cache: Optional[CacheView],
        mask,
    ) -> torch.Tensor:
        """Each query over the keys it sees, writing the chunk's keys and values to the cache: ``(T, H, Dh)``."""
        if cache is None:
            return self.kernel(xq, xk, xv, mask)
        parts = cache.parts
        if parts is not None:  # one-token sequences beside prompt chunks: each part as its own kind of pass
            out = torch.empty_like(xq)
            for rows, view in parts:
                out[rows] = self.attend(xq[rows], xk[rows], xv[rows], view, None)
            return out
        if cache.decoding:
            cache.update(xk, xv)
            return self.kernel(xq, cache.key, cache.value, cache.mask)  # keys (B*S, H_kv, Dh)
        key, value = self.cached_keys(cache, xk, xv)  # (sum(cached + T_b), H_kv, Dh)
        cache.update(xk, xv)
        return self.kernel(xq, key, value, cache.mask)

    def cached_keys(self, cache: CacheView, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's keys and values after its sequences' cached ones (``interleave_kv``)."""
        return cache.interleave_kv(xk, xv)

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias) -> torch.Tensor:
        """Attention of q ``(T_q, H, Dh)`` over k, v ``(T_k, H_kv, Dh)`` under ``bias``: ``(T_q, H, Dh)``.
        The reference is torch's SDPA (``model.attention``); a fast module may override it."""
        return attention(q, k, v, bias)


class FeedForward(nn.Module):
    """SwiGLU; with tensor parallelism, this rank's share of the hidden units."""

    def __init__(self, dim: int, hidden_dim: int, parallel: Parallel = Parallel()):
        super().__init__()
        self.parallel = parallel
        local_hidden = len(parallel.share(hidden_dim))
        self.w1 = nn.Linear(dim, local_hidden, bias=False)
        self.w2 = nn.Linear(local_hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, local_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w1(x)) * self.w3(x)  # (T, I)
        return self.parallel.all_reduce(self.w2(hidden))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, parallel: Parallel = Parallel()):
        super().__init__()
        self.attention = Attention(args, parallel)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.moe is not None:
            self.feed_forward: nn.Module = MoeLayer(args.dim, args.hidden_dim, args.moe, parallel)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim, parallel)

    def forward(self, x: torch.Tensor, rotary, cache: Optional[CacheView], mask) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotary, cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. ``parallel`` says which share of it this process holds (all of it by default).

    Layers are kept in a dict keyed by their global index, so parameter names are
    ``layers.{i}...`` whichever pipeline stage holds layer i.
    """

    def __init__(self, args: ModelArgs, parallel: Parallel = Parallel()):
        super().__init__()
        parallel.check(args)
        self.args = args
        self.parallel = parallel
        self.layer_ids = parallel.layer_range(args.n_layers)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if parallel.is_first_stage else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, parallel) for i in self.layer_ids})
        self.norm = RMSNorm(args.dim, args.norm_eps) if parallel.is_last_stage else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if parallel.is_last_stage else None

    @property
    def layer_windows(self) -> List[Optional[int]]:
        """The window of each layer this process holds (its pipeline stage's), None for full attention."""
        windows = self.args.layer_windows  # a list made anew at each read: read once
        return [windows[i] for i in self.layer_ids]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def make_cache(self, batch_size: int, max_seqlen: Optional[int] = None) -> RotatingBufferCache:
        """A cache for ``batch_size`` sequences, each layer's buffer sized on its own
        (``model.cache.layer_cache_sizes``): ``min(W, max_seqlen)`` slots for a layer with a window W,
        ``max_seqlen`` (the longest prompt plus the new tokens) for a full-attention layer."""
        for name, value, least in (("batch_size", batch_size, 1), ("max_seqlen", max_seqlen, 0)):
            if value is not None and (as_int(value) is None or as_int(value) < least):  # -1: a RuntimeError of zeros()
                raise GenerationError(f"make_cache({name}={value!r}): must be an integer >= {least}")
        batch_size, max_seqlen = as_int(batch_size), None if max_seqlen is None else as_int(max_seqlen)
        windows = self.layer_windows
        return RotatingBufferCache(
            len(self.layer_ids),
            batch_size,
            layer_cache_sizes(windows, max_seqlen),
            len(self.parallel.share(self.args.n_kv_heads)),
            self.args.head_dim,
            sliding_window=windows,
            dtype=self.dtype,
            device=self.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) every sequence's tokens, concatenated
        seqlens: List[int],
        cache: Optional[RotatingBufferCache] = None,
        logit_rows: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """Float logits ``(T, V)``. Without a cache: causal sliding-window attention per sequence.

        ``logit_rows``: the logits of these rows of ``input_ids`` only, ``(len(logit_rows), V)``: a
        prefill that needs each prompt's last logits skips the output matrix for the other tokens.
        The inputs are taken as given: ``mixtral_infer.forward`` checks them first.
        """
        if cache is not None and cache.damaged:
            raise GenerationError("the cache was left half-written by an interrupted prompt chunk: start its "
                                  "sequences again (cache.start_sequences(n)) and feed them from their first token")
        windows = self.layer_windows
        if cache is None:
            positions = torch.cat([torch.arange(n) for n in seqlens]) if seqlens else torch.zeros(0, dtype=torch.long)
            positions = positions.to(self.device)
            masks = {window: causal_attention_bias(seqlens, window, self.device) for window in set(windows)}
            metadata = None
        else:
            metadata = cache.get_input_metadata(seqlens)  # one per kind of layer (size, window)
            positions = metadata[0].positions
        rotary = rotary_angles(positions, self.args.head_dim, self.args.rope_theta)

        h = self._stage_input(input_ids)  # (T, D)
        try:
            for local_index, layer in enumerate(self.layers.values()):
                if cache is None:
                    view, mask = None, masks[windows[local_index]]
                else:
                    view = cache.get_view(local_index, metadata)
                    mask = view.mask
                h = layer(h, rotary, view, mask)
        except BaseException:  # Ctrl-C, out of memory: see RotatingBufferCache.damaged
            if cache is not None and max(seqlens, default=0) > 1:
                cache.damaged = True
            raise
        if cache is not None:
            cache.advance(seqlens)
        return self._stage_output(h, logit_rows)  # (T, V) or (len(logit_rows), V)

    def _stage_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings on the first pipeline stage; the previous stage's hidden states elsewhere."""
        if self.parallel.is_first_stage:
            return self.tok_embeddings(input_ids.to(self.device))  # token ids made on the CPU, too
        import torch.distributed as dist

        h = torch.empty(input_ids.shape[0], self.args.dim, dtype=self.dtype, device=self.device)
        dist.recv(h, src=self.parallel.rank - 1)
        return h

    def _logits(self, h: torch.Tensor, rows: Optional[List[int]]) -> torch.Tensor:
        if rows is not None:
            h = h[torch.tensor(rows, dtype=torch.long, device=h.device)]  # (R, D)
        return self.output(self.norm(h)).float()  # (R, V)

    def _stage_output(self, h: torch.Tensor, rows: Optional[List[int]] = None) -> torch.Tensor:
        """Float logits on the last stage, shared with every stage; elsewhere, pass h on."""
        if self.parallel.num_pipeline_ranks == 1:
            return self._logits(h, rows)
        import torch.distributed as dist

        if self.parallel.is_last_stage:
            logits = self._logits(h, rows)
        else:
            dist.send(h.contiguous(), dst=self.parallel.rank + 1)
            n_rows = h.shape[0] if rows is None else len(rows)
            logits = torch.empty(n_rows, self.args.vocab_size, dtype=torch.float32, device=self.device)
        dist.broadcast(logits, src=self.parallel.num_pipeline_ranks - 1)
        return logits
