"""`pushkv bench transport` in short form: real do-nothing gRPC server
processes on pushkv's contract (asyncio's and uvloop's event loops), real
clients. Asserts behaviour only: every
measurement ran (the server answered every RPC and stream message, and spent
CPU on them), and the final line's format; no figure is compared with a
bound."""

from __future__ import annotations

import os
import re

import pytest

from pushkv.bench import transport

FINAL = re.compile(
    r"^unary_us=(\d+) stream_pair_us=(\d+) unary_us_asyncio=(\d+) "
    r"stream_pair_us_asyncio=(\d+) uvloop_unary_ratio=(\d+\.\d\d|nan) "
    r"uvloop_stream_ratio=(\d+\.\d\d|nan)$"
)


def test_transport_floor_runs_and_prints_its_final_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cpus = os.sched_getaffinity(0)
    assert transport.main(["--calls", "400", "--rounds", "2", "--concurrency", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # Each round measured both servers: asyncio's event loop and uvloop's.
    rounds = [line for line in lines if line.startswith("round ")]
    assert [r.split()[2].rstrip(":") for r in rounds] == ["asyncio", "uvloop", "uvloop", "asyncio"]
    m = FINAL.match(lines[-1])
    assert m, lines[-1]
    # Each server's CPU was read from /proc: 400 RPCs of each kind cost it something.
    assert int(m[1]) + int(m[2]) > 0 and int(m[3]) + int(m[4]) > 0
    # The bench pinned its clients for the run only: this process keeps its CPUs.
    assert os.sched_getaffinity(0) == cpus


def test_transport_refuses_an_empty_measurement() -> None:
    with pytest.raises(SystemExit):
        transport.main(["--calls", "0"])
