"""Ports for listeners opened by another process a moment later: below the ephemeral range (where
outgoing connections take theirs), every port of the span free."""

from __future__ import annotations

import random
import socket

import pytest

from pretrain.cluster import ports


@pytest.mark.parametrize(
    "text, expected",
    [
        ("32768\t60999\n", (32768, 60999)),
        ("40000 50000", (40000, 50000)),
        ("", (32768, 60999)),  # empty
        ("abc def", (32768, 60999)),  # foreign
        ("70000 80000", (32768, 60999)),  # out of range
        ("5000 4000", (32768, 60999)),  # reversed
    ],
)
def test_the_ephemeral_range_is_read_and_a_damaged_file_falls_back_to_linux_default(tmp_path, text, expected):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert ports.ephemeral_range(path) == expected


def test_a_missing_range_file_falls_back_to_linux_default(tmp_path):
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)


def test_a_span_of_ports_is_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    p = ports.free_port(span=3)
    assert p + 2 < low
    for q in range(p, p + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", q))  # raises if taken


class _Scripted(random.Random):
    """Draws the given ports first, then random ones."""

    def __init__(self, first: list[int]):
        super().__init__()
        self.first = list(first)

    def randrange(self, *args):
        return self.first.pop(0) if self.first else super().randrange(*args)


def test_a_port_in_use_or_whose_neighbour_is_in_use_is_never_chosen():
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        taken = held.getsockname()[1]
        held.listen()
        assert ports.free_port(rng=_Scripted([taken])) != taken
        assert ports.free_port(span=2, rng=_Scripted([taken - 1, taken])) not in (taken - 1, taken)
