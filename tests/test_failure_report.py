"""The report a failed test prints about the vLLM engines it left running
(tests/support/failure_report.py, tests/conftest.py): each engine's key log
lines and the Python stack of every process of its group, taken with py-spy
from real processes. Here the "engine" is a real process group of two Python
processes parked in named functions, so that the stacks can be checked."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess, live_coordinators
from pushkv.harness.vllm_server import VllmServer, live_servers, track, untrack
from tests.support.failure_report import engines_report, stack
from tests.support.waits import Lines

# It builds VllmServer objects round plain Python processes and never starts
# one: the process tier (detection would say vllm from the name).
pytestmark = pytest.mark.process

PARKED = """
import subprocess, sys, time
def parked_in_the_api_server():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    child.stdout.readline()  # the worker is parked
    print("parked", flush=True)
    time.sleep(600)
    child.kill()
CHILD = '''
import time
def parked_in_a_worker():
    print("parked", flush=True)
    time.sleep(600)
parked_in_a_worker()
'''
parked_in_the_api_server()
"""


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[VllmServer]:
    log = tmp_path / "engine.log"
    log.write_text(
        "INFO starting\n"
        "WARNING pushkv: the agent's threads could not run for 3.1 s: this process starved them\n"
        "INFO nothing to see\n"
    )
    server = VllmServer(tmp_path, "parked-engine", port=1, log_path=log)
    proc = subprocess.Popen(
        [sys.executable, "-c", PARKED], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    # The harness's servers write to a log file: their Popen is of bytes.
    server.proc = proc  # type: ignore[assignment]
    Lines(proc.stdout).until("parked", timeout=30)
    track(server)
    try:
        yield server
    finally:
        server.stop()


def test_a_live_engine_reports_its_key_lines_and_every_process_stack(
    engine: VllmServer,
) -> None:
    assert engine in live_servers()
    text = engines_report()
    assert "== parked-engine" in text
    assert "could not run for 3.1 s" in text
    assert "nothing to see" not in text  # neither a key line nor a warning
    # Both processes of its group, each with its own stack.
    assert "parked_in_the_api_server" in text
    assert "parked_in_a_worker" in text
    assert len(engine.processes()) == 2


def test_a_stopped_engine_is_not_reported(engine: VllmServer) -> None:
    engine.stop()
    assert engine not in live_servers()
    assert engines_report() == ""


def test_a_stack_that_cannot_be_taken_says_why() -> None:
    # A pid that no longer runs: py-spy's own error, not an exception.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    said = stack(gone.pid)
    assert said and "Thread" not in said, said


def test_untrack_forgets(tmp_path: Path) -> None:
    server = VllmServer(tmp_path, "never-started")
    track(server)
    assert server in live_servers()
    untrack(server)
    assert server not in live_servers()


def test_the_coordinators_beside_a_live_engine_are_reported_alive_or_exited(
    engine: VllmServer,
) -> None:
    coord = CoordinatorProcess("--log-level", "INFO").start()
    try:
        assert coord in live_coordinators()
        assert f"== coordinator {coord.address} (running)" in engines_report()
        coord.kill()  # a coordinator that died on its own stays in the report
        assert f"== coordinator {coord.address} (exited with -9)" in engines_report()
    finally:
        coord.stop()
    assert coord not in live_coordinators()
    assert "== coordinator" not in engines_report()
