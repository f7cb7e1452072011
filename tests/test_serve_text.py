"""Streamed text: incremental detokenizing equals decoding the whole answer; stop strings."""

import pytest

from mixtral_infer.generation.text_stream import StopStrings, TextStream
from mixtral_infer.tokenizer import Tokenizer

TEXTS = [
    "And the LORD spake unto Moses, saying,",
    "Blessed are the meek: for they shall inherit the earth.",
    "élan, naïve café — 日本語 🙂 and  two  spaces",  # multi-byte characters through byte fallback
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder("tiny-mixtral")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("leading_space", [True, False])
def test_pieces_add_up_to_the_decoded_answer(tokenizer, text, leading_space):
    ids = tokenizer.encode(text, bos=False)
    detokenizer = TextStream(tokenizer, leading_space)
    pieces = [detokenizer.push(token) for token in ids]
    pieces.append(detokenizer.finish())
    expected = tokenizer.decode(ids)
    if leading_space and tokenizer.id_to_piece(ids[0]).startswith("\u2581"):
        expected = " " + expected
    assert "".join(pieces) == expected
    assert all("\ufffd" not in piece for piece in pieces)  # half characters are held back, never shown
    assert sum(1 for piece in pieces if piece) > len(ids) // 2  # streamed, not all at the end


def test_half_a_character_is_held_back_and_flushed(tokenizer):
    emoji = tokenizer.encode("🙂", bos=False)
    assert len(emoji) > 1  # byte fallback: one token per byte
    detokenizer = TextStream(tokenizer, leading_space=False)
    assert [detokenizer.push(t) for t in emoji[:-1]] == [""] * (len(emoji) - 1)
    # An answer cut in the middle of a character ends as decode shows it: U+FFFD per stray byte.
    flushed = detokenizer.finish()
    assert flushed == tokenizer.decode(emoji[:-1]) and flushed.endswith("\ufffd")


def test_stop_strings_docstring_example():
    stops = StopStrings(["\n\n", "END"])
    assert [stops.push(piece) for piece in ["a E", "N", "Db"]] == ["a ", "", ""]
    assert stops.stopped and stops.text == "a "


def test_stop_strings_release_held_text_that_was_not_a_stop():
    stops = StopStrings(["END"])
    assert stops.push("the E") == "the "
    assert stops.push("nd") == "End"  # "End" is not "END": released
    assert not stops.stopped
    assert stops.push(" EN") == " "
    assert stops.flush() == "EN"  # at the end of the answer, the held tail is text


def test_stop_string_across_pieces_and_the_earliest_wins():
    stops = StopStrings(["cd", "b"])
    assert stops.push("a") == "a"
    assert stops.push("bcd") == ""
    assert stops.stopped and stops.text == "a"
