"""IncrementalDetokenizer: streamed pieces are final, and together equal decoding the whole output at once."""

import random
from pathlib import Path

import pytest

from sparkspec.tokenizer import IncrementalDetokenizer, Tokenizer

DEMO = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO)


def stream(tok, ids, rng):
    """Feed `ids` in random chunks of 1-5 tokens; check every step against a full decode."""
    detok = IncrementalDetokenizer(tok)
    shown, pos = "", 0
    while pos < len(ids):
        n = rng.randint(1, 5)
        shown += detok.feed(ids[pos : pos + n])
        pos += n
        full_so_far = tok.decode(ids[:pos], skip_special_tokens=True)
        assert full_so_far.startswith(shown)  # nothing shown is ever taken back
        assert detok.text == shown
    shown += detok.flush()
    assert shown == tok.decode(ids, skip_special_tokens=True)
    return detok


@pytest.mark.parametrize("seed", range(6))
def test_random_token_streams_match_a_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]  # byte tokens, special tokens, anything
    stream(tok, ids, rng)


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode("héllo wörld 日本語 🎉 ok " * 5)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tok)
    for i in ids:  # one token at a time: the worst case for split characters
        piece = detok.feed([i])
        assert "\ufffd" not in piece
    assert detok.text + detok.flush() == tok.decode(ids)
    stream(tok, ids, rng)


def test_special_tokens_are_skipped_and_do_not_grow_the_window(tok):
    eos = tok.eos_token_id
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(tok.encode("Hi")) == "Hi"
    for _ in range(100):
        assert detok.feed([eos]) == ""
    assert len(detok._window) <= 2
    assert detok.feed(tok.encode(" there")) == " there"


def test_an_incomplete_tail_is_released_by_flush(tok):
    ids = tok.encode("🎉")
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])  # the replacement character(s) of the cut bytes
