"""How to choose tokens, as one object from the front doors to the steps: ``SamplingParams``.

``LLM`` and the command line make one, ``generate`` and the ``Conversation`` take one (or its fields
as keyword arguments, which fill it), the server's request parsing makes the engine's
``RequestSettings``, which is one with the request's own fields added. ``check`` refuses a value
out of range with one line naming the field; ``to_sampling`` gives the per-row tensors
(``sampling.Sampling``) that the decode steps read; the penalties, logit bias, stop strings and
what the text must be are applied by ``structured`` (``Shaping``, the engine's rows). A new option
is a field here, a line in ``check`` and the code that applies it.

The command line checks its options before it loads the model or imports torch, so this module
imports torch (through ``sampling``) only in ``to_sampling``.

>>> params = SamplingParams(max_tokens=4, temperature=0.7, top_k=40)
>>> params.check().top_k, params.filtered(vocab_size=32000), params.filtered(vocab_size=40)
(40, True, False)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

from mixtral_infer.errors import GenerationError, as_int

if TYPE_CHECKING:
    import torch

    from mixtral_infer.sampling import Sampling

# A temperature this small samples the most probable token whatever the logits (for
# float32 logits below 1e8 in size, softmax(logits / T) is one-hot), while dividing by
# it can overflow to inf and make NaN probabilities. So it is run as greedy, the limit.
GREEDY_BELOW = 1e-30
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch
SEED_LIMIT = 2**63  # seeds go through int64 tensors (shared across ranks)
CONSTRAINTS = (("json_schema", "json_schema"), ("regex", "regex"), ("choices", "choice"), ("grammar", "lark"))
PENALTIES = (("presence_penalty", 0.0, -2, 2), ("frequency_penalty", 0.0, -2, 2), ("repetition_penalty", 1.0, 1e-6, 10))

PerRow = Union[float, Sequence[float]]  # one number for every prompt, or a list of one per prompt


@dataclass
class SamplingParams:
    """How to choose tokens, as vLLM's ``SamplingParams`` (its defaults: temperature 1, 16 tokens).

    ``n``: answers per prompt (``LLM``), all sampled after one reading of it; with a seed, answer
    ``i`` samples with ``seed + i`` (as the server's ``n``). ``seed``: each prompt samples with its
    own generator, so its text is the same in any batch (``generate`` takes a list, one per prompt).
    The penalties: one number, or (``generate``) a list of one per prompt. ``json_schema``,
    ``regex``, ``choices``, ``grammar`` (Lark): what the text must be, one of them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Union[None, int, Sequence[int]] = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    presence_penalty: PerRow = 0.0
    frequency_penalty: PerRow = 0.0
    repetition_penalty: PerRow = 1.0
    logit_bias: Optional[Dict[int, float]] = None
    min_tokens: int = 0
    json_schema: Optional[Union[dict, str]] = None  # what the text must be (one of these four)
    regex: Optional[str] = None
    choices: Optional[Sequence[str]] = None
    grammar: Optional[str] = None  # Lark
    n: int = 1  # answers per prompt (last: the fields before it keep their positions)

    @classmethod
    def names(cls) -> List[str]:
        return [f.name for f in fields(SamplingParams)]

    def updated(self, overrides: Dict[str, Any]) -> "SamplingParams":
        """A copy with ``overrides`` (field name to value); GenerationError for a name that is not a field."""
        unknown = sorted(set(overrides) - set(SamplingParams.names()))
        if unknown:
            raise GenerationError(f"unknown sampling setting(s) {unknown}: SamplingParams has {sorted(SamplingParams.names())}")
        return replace(self, **overrides)

    # ---- checks ------------------------------------------------------------------------------

    def check(self, batch: Optional[int] = None, vocab_size: Optional[int] = None) -> "SamplingParams":
        """GenerationError, one line naming the field, for a value out of range or of the wrong type
        (strings from a command line too); else a copy whose integers are Python ints. ``batch``:
        the prompts, which a list of seeds or penalties must match; ``vocab_size``: logit_bias's keys."""
        tokens = as_int(self.max_tokens)
        if tokens is None or tokens < 0:
            raise GenerationError(f"max_tokens={self.max_tokens!r} must be an integer >= 0")
        temperature = self.temperature
        if not _is_number(temperature):
            raise GenerationError(f"temperature={temperature!r} must be a number >= 0 (0 means greedy)")
        if not temperature >= 0:
            raise GenerationError(f"temperature={temperature!r} must be >= 0 (0 means greedy)")
        if not _is_number(self.top_p):
            raise GenerationError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k is not None and (as_int(self.top_k) is None or as_int(self.top_k) < 1):
            raise GenerationError(f"top_k={self.top_k!r} must be an integer >= 1 (or None for no limit)")
        seed = self._checked_seed(batch)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise GenerationError(f"n={self.n!r} must be an integer >= 1 (answers per prompt)")
        self._check_shaping(tokens, batch, vocab_size)
        top_k = None if self.top_k is None else as_int(self.top_k)
        return replace(self, max_tokens=tokens, top_k=top_k, seed=seed, min_tokens=as_int(self.min_tokens))

    def _checked_seed(self, batch: Optional[int]) -> Union[None, int, List[int]]:
        if not isinstance(self.seed, (list, tuple)):
            check_seed(self.seed)
            return None if self.seed is None else as_int(self.seed)
        if batch is not None and len(self.seed) != batch:
            raise GenerationError(f"seed={self.seed!r:.40} must be one integer, or a list of one per prompt ({batch})")
        for index, value in enumerate(self.seed):
            check_seed(value, f"seed[{index}]")
        return [as_int(value) for value in self.seed]

    def _check_shaping(self, max_tokens: int, batch: Optional[int], vocab_size: Optional[int]) -> None:
        given = [name for name, _ in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise GenerationError(f"give one of {', '.join(given)}: each says what the answers must be")
        stop = self.stop
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise GenerationError(f"stop={stop!r} must be a list of non-empty strings")
        for name, _, low, high in PENALTIES:
            value = getattr(self, name)
            listed = isinstance(value, (list, tuple))
            values = list(value) if listed else [value] if isinstance(value, (int, float)) else None
            if values is None or (listed and batch is not None and len(values) != batch):
                raise GenerationError(f"{name}={value!r} must be a number, or a list of one per prompt ({batch or 'B'})")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high for v in values):
                raise GenerationError(f"{name}={value!r} must be a number in [{low:g}, {high:g}] (or a list of them)")
        if as_int(self.min_tokens) is None or not 0 <= as_int(self.min_tokens) <= max_tokens:
            raise GenerationError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={max_tokens}]")
        vocab = "the vocabulary" if vocab_size is None else f"[0, {vocab_size})"
        for token, bias in (self.logit_bias or {}).items():
            outside = as_int(token) is None or as_int(token) < 0 or (vocab_size is not None and as_int(token) >= vocab_size)
            if outside or isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise GenerationError(f"logit_bias {{{token!r}: {bias!r}}}: keys must be token ids in {vocab}, values numbers")

    # ---- what the steps and the shaping read ---------------------------------------------------

    @property
    def penalised(self) -> bool:
        """Whether any penalty is other than neutral (for any row)."""
        values = [(getattr(self, name), neutral) for name, neutral, _, _ in PENALTIES]
        return any(v != neutral for value, neutral in values for v in (value if isinstance(value, (list, tuple)) else [value]))

    @property
    def constraint(self) -> Optional[tuple]:
        """``(kind, value)`` of what the text must be (``structured.grammar.Constraint``'s), or None."""
        for name, kind in CONSTRAINTS:
            if getattr(self, name) is not None:
                return kind, getattr(self, name)
        return None

    @property
    def shaped(self) -> bool:
        """Whether the logits are changed before sampling (``structured.rows.Shaping``)."""
        return bool(self.constraint or self.stop or self.penalised or self.logit_bias or self.min_tokens)

    @property
    def effective_temperature(self) -> float:
        """The temperature the steps run: ``effective_temperature``."""
        return effective_temperature(float(self.temperature))

    def filtered(self, vocab_size: int) -> bool:
        """Whether a sampled row of these settings has a top-k or top-p limit (the sort's path)."""
        return (self.top_k is not None and int(self.top_k) < vocab_size) or self.top_p < 1.0

    def to_sampling(self, batch: int, vocab_size: int, device: "torch.device | str" = "cpu") -> "Sampling":
        """The same settings for ``batch`` rows, as the per-row tensors the steps read."""
        from mixtral_infer.sampling import Sampling

        top_k = None if self.top_k is None else int(self.top_k)
        return Sampling.uniform_settings(batch, vocab_size, self.effective_temperature, self.top_p, top_k, device)


def rows_sampling(rows: Sequence[SamplingParams], vocab_size: int, device: "torch.device", filtered: bool) -> "Sampling":
    """Each row's own settings (all sampled, ``filtered`` alike), as the steps' per-row tensors."""
    import torch

    from mixtral_infer.sampling import Sampling

    return Sampling(
        temperature=torch.tensor([float(p.temperature) for p in rows], dtype=torch.float32, device=device),
        top_p=torch.tensor([float(p.top_p) for p in rows], dtype=torch.float32, device=device),
        top_k=torch.tensor([min(int(p.top_k or vocab_size), vocab_size) for p in rows], dtype=torch.long, device=device),
        greedy=False,
        filtered=filtered,
    )


def _is_number(value: object) -> bool:
    """A real number of any kind (numpy's ``float32`` too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_seed(seed: object, name: str = "seed") -> None:
    """A seed: None, or an integer in [0, 2**63); GenerationError naming it otherwise."""
    if seed is not None and (as_int(seed) is None or not 0 <= as_int(seed) < SEED_LIMIT):
        raise GenerationError(f"{name}={seed!r} must be an integer in [0, 2**63) (or None for a random one)")


def effective_temperature(temperature: float) -> float:
    """0 (greedy) for temperatures below ``GREEDY_BELOW``, which sample the top token anyway; inf
    (uniform, the other limit) for those past float32's largest number (3.4e38), in which the
    sampling runs and which they would overflow."""
    if temperature < GREEDY_BELOW:
        return 0.0
    return float("inf") if temperature > FLOAT32_MAX else float(temperature)
