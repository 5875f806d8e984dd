"""`pushkv bench transport` in short form: a real do-nothing gRPC server
process on pushkv's contract, real clients. Asserts behaviour only: every
measurement ran (the server answered every RPC and stream message, and spent
CPU on them), and the final line's format; no figure is compared with a
bound."""

from __future__ import annotations

import os
import re

import pytest

from bench import transport

FINAL = re.compile(
    r"^unary_us=(\d+) unary_8_calls_us=(\d+) unary_64_calls_us=(\d+) "
    r"stream_pair_us=(\d+) unary_rpcs_per_core=(\d+|nan)$"
)


def test_transport_floor_runs_and_prints_its_final_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cpus = os.sched_getaffinity(0)
    assert transport.main(["--calls", "400", "--rounds", "2", "--concurrency", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("round ") for line in lines) == 2
    m = FINAL.match(lines[-1])
    assert m, lines[-1]
    # The server's CPU was read from /proc: 400 RPCs of each kind cost it something.
    assert sum(int(g) for g in m.groups()[:4]) > 0
    # The bench pinned its clients for the run only: this process keeps its CPUs.
    assert os.sched_getaffinity(0) == cpus


def test_transport_refuses_an_empty_measurement() -> None:
    with pytest.raises(SystemExit):
        transport.main(["--calls", "0"])
