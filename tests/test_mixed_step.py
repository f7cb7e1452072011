"""The static mixed step equals Transformer.forward's ragged pass: logits and the cache it leaves."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer.steps.mixed_step import (
    cached_positions,
    chunk_visibility,
    chunk_writes,
    mixed_logits,
    pack_chunk,
)

ROWS = 6


def test_worked_example_of_visibility_and_writes():
    """The module docstring's example: S = 4, window 4; row 1 at 6 reads 3 tokens, row 0 new reads 2."""
    chunk = pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])], size=6, segments=2)
    assert cached_positions(chunk.starts, 4).tolist() == [[4, 5, 2, 3], [-4, -3, -2, -1]]
    assert chunk.place.tolist() == [0, 1, 2, 0, 1, 5]
    assert chunk.line == 6 and pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])]).line == 3  # padded: C places
    visible = chunk_visibility(chunk, 4, window=4)  # (2 segments, 6 places, 4 slots + 6 chunk places)
    seen = [[[j for j in range(10) if visible[k, i, j]] for i in range(6)] for k in range(2)]
    # keys 0-3: the segment's row's slots; 4-9: its places in the chunk
    assert seen[0][0] == [0, 1, 3, 4]  # position 6: cached 4, 5, 3 (slot 2 holds 2: out of the window), itself
    assert seen[0][1] == [0, 1, 4, 5]  # position 7: cached 4, 5 (7 - 3 = 4 is out of the window), chunk 6, 7
    assert seen[0][2] == [1, 4, 5, 6]  # position 8: cached 5, chunk 6, 7, 8
    assert seen[1][0] == [4] and seen[1][1] == [4, 5]  # segment 1: positions 0, 1, nothing cached
    assert seen[0][5] == [9] and seen[1][3] == [7]  # places without a token: their own place only
    rows, slots, source = chunk_writes(chunk, 4)
    assert rows[:5].tolist() == [1, 1, 1, 0, 0] and slots[:5].tolist() == [2, 3, 0, 0, 1]
    assert source.tolist() == [0, 1, 2, 3, 4, 4]  # the padding token repeats the last valid write


def test_pack_chunk_docstring_example():
    chunk = pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])], size=6, segments=3)
    assert chunk.tokens.tolist() == [11, 12, 13, 21, 22, 0] and chunk.valid.tolist() == [True] * 5 + [False]
    assert chunk.positions.tolist() == [6, 7, 8, 0, 1, 0] and chunk.segment.tolist() == [0, 0, 0, 1, 1, 0]
    assert chunk.rows.tolist() == [1, 0, 0] and chunk.starts.tolist() == [6, 0, 0] and chunk.last.tolist() == [2, 4, 0]


def test_chunk_longer_than_the_buffer_writes_each_slot_with_its_latest_token():
    chunk = pack_chunk([(2, 0, [1, 2, 3, 4, 5, 6])])
    rows, slots, source = chunk_writes(chunk, 4)
    assert source.tolist() == [4, 5, 2, 3, 4, 5]
    assert slots.tolist() == [0, 1, 2, 3, 0, 1] and set(rows.tolist()) == {2}


def test_pack_chunk_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        pack_chunk([(0, 0, [1, 2, 3])], size=2)
    with pytest.raises(ValueError, match="do not fit"):
        pack_chunk([(0, 0, [1]), (1, 0, [2])], segments=1)
    with pytest.raises(ValueError, match="no token"):
        pack_chunk([(0, 0, [])])


def fill(model, cache, seen, generator):
    """Feed each row ``seen[row]`` random tokens through the eager path (prompts of any length)."""
    tokens = torch.randint(0, model.args.vocab_size, (sum(seen),), generator=generator)
    model(tokens, seen, cache)


# Each case: tokens seen per row before the step, then what the row does in it: "d" decodes one
# token, an int reads that many prompt tokens, None sits out.
CASES = {
    "fresh prompts beside decoding rows": ([5, 0, 3, 0, 9, 2], ["d", 4, "d", 7, "d", None]),
    "prompts continued, past the window": ([3 * WINDOW + 1, 5, 2 * WINDOW, 1, 0, WINDOW], ["d", 6, 3, "d", None, WINDOW]),
    "a chunk longer than the buffer": ([2, 0, WINDOW + 3, 0, 1, 4], ["d", 2 * WINDOW + 3, 1, 5, "d", "d"]),
    "prompts only": ([0, 0, 4, 0, 0, 0], [None, 3, 2 * WINDOW, None, 1, None]),
}


@pytest.mark.parametrize("moe", ["mistral", "mixtral", "mixtral-grouped"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [WINDOW, None], ids=["window", "no-window"])
def test_mixed_step_equals_the_eager_pass(case, moe, padded, window):
    """Logits of the decoding rows and of each prompt's last chunk token, and every slot of the cache."""
    model = random_model(tiny_args(moe=moe != "mistral", sliding_window=window, max_batch_size=ROWS), seed=31)
    seen, plan = CASES[case]
    generator = torch.Generator().manual_seed(sum(seen))
    with torch.no_grad():
        eager = model.make_cache(ROWS, max_seqlen=WINDOW if window else 4 * WINDOW)
        eager.start_sequences(ROWS)
        fill(model, eager, seen, generator)
        mixed_k, mixed_v = eager.cache_k.clone(), eager.cache_v.clone()

        new = {row: torch.randint(0, model.args.vocab_size, (1 if what == "d" else what,), generator=generator).tolist()
               for row, what in enumerate(plan) if what is not None}  # fmt: skip
        seqlens = [len(new.get(row, [])) for row in range(ROWS)]
        ends = list(itertools.accumulate(seqlens))
        reading = [row for row in range(ROWS) if plan[row] not in ("d", None)]
        decoding = [row for row in range(ROWS) if plan[row] == "d"]
        flat = torch.tensor([t for row in range(ROWS) for t in new.get(row, [])])
        expected = model(flat, seqlens, eager, logit_rows=[ends[r] - 1 for r in decoding + reading])

        tokens = torch.tensor([new[r][0] if r in decoding else 0 for r in range(ROWS)])
        alive = torch.tensor([r in decoding for r in range(ROWS)])
        pieces = [(row, seen[row], new[row]) for row in reading]
        size = sum(len(p[2]) for p in pieces)
        chunk = pack_chunk(pieces, size=size + 5 if padded else None, segments=len(pieces) + 2 if padded else None)
        logits = mixed_logits(model, mixed_k, mixed_v, tokens, torch.tensor(seen), alive, chunk, moe == "mixtral-grouped")

    got = torch.cat([logits[decoding], logits[ROWS : ROWS + len(reading)]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed_k, eager.cache_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed_v, eager.cache_v, atol=1e-5, rtol=1e-5)


def test_the_mixed_step_compiles_with_fullgraph_and_equals_eager():
    model = random_model(tiny_args(moe=True, max_batch_size=4), seed=32)
    cache = model.make_cache(4)
    cache.start_sequences(4)
    with torch.no_grad():
        fill(model, cache, [3, 0, WINDOW + 2, 1], torch.Generator().manual_seed(0))
        inputs = (torch.tensor([7, 0, 9, 0]), torch.tensor([3, 0, WINDOW + 2, 1]), torch.tensor([True, False, True, False]))
        chunk = pack_chunk([(1, 0, [4, 5, 6]), (3, 1, list(range(2 * WINDOW)))], size=32, segments=3)
        expected_k, expected_v = cache.cache_k.clone(), cache.cache_v.clone()
        expected = mixed_logits(model, expected_k, expected_v, *inputs, chunk)
        compiled = torch.compile(mixed_logits, fullgraph=True, dynamic=False)
        got = compiled(model, cache.cache_k, cache.cache_v, *inputs, chunk)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.cache_k, expected_k, atol=1e-5, rtol=1e-5)


def test_a_prompt_never_reads_another_prompts_keys():
    """A NaN in one prompt's row (a pass that went wrong) reaches neither the other prompt of its
    chunk nor the decoding rows: they get the logits they get beside a clean row."""
    model = random_model(tiny_args(moe=True, max_batch_size=4), seed=33)
    cache = model.make_cache(4)
    cache.start_sequences(4)
    with torch.no_grad():
        fill(model, cache, [5, 3, 2, 1], torch.Generator().manual_seed(1))
        inputs = (torch.tensor([7, 0, 0, 9]), torch.tensor([5, 3, 2, 1]), torch.tensor([True, False, False, True]))
        chunk = pack_chunk([(1, 3, [4, 5, 6]), (2, 2, [8, 9])], size=8, segments=3)
        clean = mixed_logits(model, cache.cache_k.clone(), cache.cache_v.clone(), *inputs, chunk)
        cache.cache_k[:, 1], cache.cache_v[:, 1] = float("nan"), float("nan")
        broken = mixed_logits(model, cache.cache_k, cache.cache_v, *inputs, chunk)
    assert broken[4].isnan().all()  # row 1's prompt
    torch.testing.assert_close(broken[[0, 3, 5]], clean[[0, 3, 5]])  # the decoding rows, row 2's prompt
