"""The incremental detokenizer (torch-free): deltas add up to the full decode, multi-byte characters
wait for their last byte, each token decodes a short window (not the whole output), stop strings
are found across token boundaries and never shown, held-back text is released when it cannot
become a stop string or when the output ends."""

from __future__ import annotations

import pytest

from kvstate.engine.detokenizer import IncrementalDetokenizer

# a byte-level toy vocabulary: token i is a few bytes; "é" (c3 a9) and "✓" (e2 9c 93) are split
VOCAB = [b"a", b"b", b"c", b"L", b"ck", b" ", b"\xc3", b"\xa9", b"\xe2\x9c", b"\x93", b"x", b"Lc"]


class CountingDecode:
    """bytes -> text as a byte-level decoder does (invalid bytes become U+FFFD); records window sizes."""

    def __init__(self):
        self.windows: list[int] = []

    def __call__(self, ids: list[int]) -> str:
        self.windows.append(len(ids))
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def run(ids, stop=()):
    decode = CountingDecode()
    d = IncrementalDetokenizer(decode, stop)
    deltas, hit = [], None
    for t in ids:
        hit = d.add(t)
        if hit is not None:
            break
        deltas.append(d.take())
    d.finish()
    deltas.append(d.take())
    return d, deltas, hit, decode


def test_deltas_add_up_to_the_full_decode_and_wait_for_whole_characters():
    ids = [0, 6, 7, 5, 8, 9, 1, 6]  # "aé ✓b" then a lone lead byte at the end
    d, deltas, hit, _ = run(ids)
    full = CountingDecode()(ids)
    assert hit is None and "".join(deltas) == d.text == full
    assert deltas[1] == "" and deltas[2] == "é" and deltas[4] == "" and deltas[5] == "✓"
    assert all("\ufffd" not in x for x in deltas[:-1]) and deltas[-1] == "\ufffd"  # flushed at the end


def test_each_token_decodes_a_short_window():
    ids = [0, 1, 2, 5] * 50
    _, deltas, _, decode = run(ids)
    assert "".join(deltas) == "abc " * 50
    assert max(decode.windows) <= 3  # never the whole output again (200 tokens)


@pytest.mark.parametrize("ids, stop, text", [
    ([0, 3, 4, 1], ["Lck"], "a"),  # the stop string across two tokens
    ([0, 11, 4, 1], ["ck"], "aLc"),  # inside a token: the text before it stays
    ([0, 3, 1, 3, 4], ["Lck", "Lb"], "a"),  # the earliest of several stop strings
    ([10, 6, 7, 3, 4], ["éL"], "x"),  # after a multi-byte character
])
def test_stop_strings_end_the_text_and_are_never_shown(ids, stop, text):
    d, deltas, hit, _ = run(ids, stop)
    assert hit is not None and d.stop_reason == hit and d.text == text
    assert "".join(deltas) == text
    shown = ""
    for x in deltas:
        shown += x
        assert not any(s in shown for s in stop)


def test_held_back_text_is_released_once_it_cannot_be_a_stop_string():
    decode = CountingDecode()
    d = IncrementalDetokenizer(decode, ["Lck"])
    d.add(0)
    assert d.take() == "a"
    d.add(3)
    assert d.take() == ""  # "L" may start "Lck"
    d.add(1)
    assert d.take() == "Lb"  # "Lb" cannot
    d.add(11)
    assert d.take() == ""  # "Lc" may
    d.finish()  # the output ended for another reason: release it
    assert d.take() == "Lc" and d.text == "aLbLc"
