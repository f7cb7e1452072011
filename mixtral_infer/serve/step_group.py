"""A serving engine whose model is cut across processes (torchrun): rank 0 decides, every rank runs the passes.

Under ``torchrun --nproc-per-node N main.py serve MODEL --tensor-parallel N`` (or
``--num-pipeline-ranks N``) every rank loads its share of the model and builds the same ``Engine``
(the same rows, cache and options). Rank 0's engine, in the server's engine process
(``engine_process``), schedules, samples and answers; the others only follow. Each change rank 0 makes
to the model's state is one *effect*, an ``Engine`` method of plain arguments (``EFFECTS``): a pass over
the ragged batch, a row cleared, copied or cut back, the slack saved before a pass. Rank 0 applies it
and sends it; every other rank applies it to its own share, in the same order, and so enters the
pass's collectives (tensor parallelism's all-reduces, the pipeline's sends) with rank 0::

    rank 0 (the engine process)                              ranks 1 .. N-1 (``follow``)
    _effect("clear_rows", [2])    applied, queued
    _effect("forward", ...)       applied after one broadcast:  [("clear_rows", ...), ("forward", ...)]
                                                                  -> each applied in order
    the pass: an all-reduce per layer      <---------------->     the same pass on each share
    logits -> sampling, grammar, stop strings (rank 0 only)

Effects without a collective wait and go with the next pass, so a step costs one broadcast
(``broadcast_object_list``: gloo on CPU, NCCL on GPUs) besides the pass's own collectives. Sampling
happens once, on rank 0: the other ranks' logits are not read.

Faults: every collective of the group has the timeout the group was made with (``--collective-timeout``);
while idle, rank 0 sends a heartbeat every quarter of it, a barrier of every rank. A rank that dies (its sockets close) or
hangs (a collective times out) ends every other rank with one line (``GroupLost``), never a silent
hang; rank 0's engine process then ends, and its server stops. Each pass carries rank 0's
``tokens_seen``: a rank whose cache is out of step with rank 0's says so and stops, rather than
answering wrongly. ``stop`` (rank 0's engine shutting down) ends the others' ``follow`` normally.
"""

from __future__ import annotations

import re
import time
from typing import Any, List, Optional, Sequence, Tuple

from mixtral_infer.errors import MixtralInferError

# The Engine's methods that change the model's state, by effect name (rank 0 sends the name).
EFFECTS = {
    "forward": "_pass",  # one pass over a ragged flat batch (its collectives inside)
    "clear_rows": "_clear_cache_rows",
    "undamage": "_undamage",
    "cut_back": "_cut_back",
    "copy_row": "_copy_cache_row",
    "save": "_save_slack",
}
WITH_COLLECTIVES = {"forward"}  # effects that must reach the other ranks before rank 0 applies them
DEFAULT_TIMEOUT_S = 120.0  # --collective-timeout's default

Effect = Tuple[str, tuple]


class GroupLost(MixtralInferError):
    """Another rank died, hung past the collective timeout, or went out of step: the group cannot go on."""


class StepGroup:
    """This process's side of the group. On rank 0, ``send`` queues an effect and ``flush`` broadcasts
    what is queued; on the others, ``receive`` returns the next list of effects. ``timeout_s``: the
    process group's own collective timeout, which the heartbeat stays well within."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise MixtralInferError("a StepGroup needs the process group joined first (torchrun, --tensor-parallel)")
        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = timeout_s
        self.heartbeat_s = timeout_s / 4
        self.pending: List[Effect] = []
        self.last_sent = time.monotonic()
        self.lost: Optional[str] = None  # why the group cannot go on, once it cannot

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    # ---- rank 0 ---------------------------------------------------------------------------

    def send(self, name: str, args: tuple) -> None:
        """Queue one effect; one with collectives goes at once, with what was queued before it."""
        self.pending.append((name, args))
        if name in WITH_COLLECTIVES:
            self.flush()

    def flush(self) -> None:
        effects, self.pending = self.pending, []
        self._broadcast(effects)

    def heartbeat(self) -> None:
        """While idle, every ``heartbeat_s``: a barrier of every rank, so that the others' waits never
        time out, and a rank that hangs is found within the timeout even when no request comes."""
        if time.monotonic() - self.last_sent >= self.heartbeat_s:
            self.pending.append(("heartbeat", ()))
            self.flush()
            self.barrier()

    def barrier(self) -> None:
        try:
            self.dist.barrier()
        except Exception as error:
            raise self.lose(error) from None

    def stop(self) -> None:
        """The others' ``follow`` returns (rank 0's engine is shutting down)."""
        self.pending.append(("stop", ()))
        self.flush()

    # ---- every rank -----------------------------------------------------------------------

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the rows rank 0 planned, before the engines are built)."""
        return self._broadcast(value)

    def receive(self) -> List[Effect]:
        return self._broadcast(None)

    def _broadcast(self, value: Any) -> Any:
        if self.lost is not None:
            raise GroupLost(self.lost)
        box = [value]
        try:
            self.dist.broadcast_object_list(box, src=0)
        except Exception as error:  # a peer's sockets closed, or the timeout passed
            raise self.lose(error) from None
        self.last_sent = time.monotonic()
        return box[0]

    def lose(self, error: BaseException) -> GroupLost:
        """The group is broken (``error`` in one of its collectives, or in a pass that has them): why, as the error to raise."""
        self.lost = f"a process of the model's group died or hangs ({self.describe()} saw {one_line(error)})"
        return GroupLost(self.lost)


def follow(engine, group: StepGroup) -> None:
    """Ranks other than 0: apply rank 0's effects to this rank's engine until rank 0 stops. Raises
    ``GroupLost`` when rank 0 goes, hangs, or this rank's cache is out of step with rank 0's."""
    import torch

    with torch.inference_mode():
        while True:
            for name, args in group.receive():
                if name == "stop":
                    return
                if name == "heartbeat":
                    group.barrier()
                    continue
                try:
                    getattr(engine, EFFECTS[name])(*args)
                except GroupLost:
                    raise
                except Exception as error:  # applied on rank 0 but not here: the ranks would answer apart
                    group.lost = f"{group.describe()} could not apply rank 0's {name!r}: {one_line(error)}"
                    raise GroupLost(group.lost) from None


def check_in_step(seen: Sequence[int], here: Sequence[int], group: StepGroup) -> None:
    """Rank 0's ``tokens_seen`` before a pass against this rank's: out of step is the end of the group."""
    if list(seen) != list(here):
        group.lost = (f"{group.describe()}: its cache is out of step with rank 0's (tokens per row "
                      f"{list(here)}, rank 0's {list(seen)})")  # fmt: skip
        raise GroupLost(group.lost)


def one_line(error: BaseException) -> str:
    """The error's first line without a source location (gloo's ``[.../pair.cc:553] ``), at most 200 characters."""
    lines = str(error).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
