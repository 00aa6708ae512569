"""Resumable SHA-256 (issue 56's core): a digest's chain state exported by
one ``MultiHasher`` and continued by another (here standing for another
rank), at any cut and over many chains at once, equals hashlib's digest of
the whole message; a state that is not one is refused by index."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from weight_checker._core import MultiHasher


def chained(message: bytes, cuts: list[int]) -> str:
    """The digest of ``message`` fed in pieces, each piece by a fresh hasher
    resumed from the previous one's exported state."""
    state: bytes | None = None
    bounds = [0, *sorted(cuts), len(message)]
    for a, b in itertools.pairwise(bounds):
        hasher = MultiHasher.resume([state])
        hasher.update([(0, message[a:b])])
        (state,) = hasher.export_states()
        assert len(state) <= 109
    (digest,), _ = MultiHasher.resume([state]).finish()
    return digest


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=5000), st.lists(st.integers(min_value=0, max_value=5000), max_size=6))
def test_a_digest_continued_from_exported_states_at_any_cuts_is_hashlibs(message, cuts):
    cuts = [min(c, len(message)) for c in cuts]
    assert chained(message, cuts) == hashlib.sha256(message).hexdigest()


def test_many_chains_continue_at_once_through_the_lanes():
    messages = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate([0, 1, 63, 64, 65, 1 << 20, 3 << 20])]
    first = MultiHasher(len(messages))
    first.update([(i, m[: len(m) // 3]) for i, m in enumerate(messages)])
    second = MultiHasher.resume(first.export_states())
    second.update([(i, m[len(m) // 3 :]) for i, m in enumerate(messages)])
    digests, zeros = second.finish()
    assert digests == [hashlib.sha256(m).hexdigest() for m in messages]
    assert zeros == [len(m) == 0 for m in messages]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda s: b"XXXX" + s[4:], "not a weight-checker SHA-256 chain state"),
        (lambda s: s[:-1], "tail"),
        (lambda s: s[:36] + bytes([s[36] ^ 1]) + s[37:], "whole 64-byte blocks"),
    ],
    ids=["magic", "cut", "length"],
)
def test_a_state_that_is_not_one_is_refused_naming_its_index(edit, why):
    h = MultiHasher(1)
    h.update([(0, b"x" * 70)])
    (state,) = h.export_states()
    with pytest.raises(ValueError, match=rf"state #1: .*{why}"):
        MultiHasher.resume([None, edit(state)])
