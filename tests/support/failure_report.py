"""What a failed test prints about the vLLM engines still running: each
engine's key log lines and the Python stack of each of its processes, taken
with py-spy while the engine is still in the state that failed the test (a
request that got no answer, a burst that never got in flight). The fixtures
stop the engines only after this report is taken (tests/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from pushkv.harness.coordinator import CoordinatorProcess, live_coordinators
from pushkv.harness.vllm_server import VllmServer, live_servers
from tests.support.reference import REFERENCE_PREFIX
from tests.support.serving import KEY_MARKS, LOG_MARKS, hang_dump

DUMP_S = 20.0  # one process's stack dump; a frozen process must not hang the report


def py_spy() -> str:
    """The py-spy executable beside this interpreter (the dev extra), or on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise FileNotFoundError("py-spy is not installed (pip install -e '.[dev]')")
    return found


def stack(pid: int) -> str:
    """Every thread's Python stack in process `pid` (py-spy dump), or why not."""
    try:
        done = subprocess.run(
            [py_spy(), "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=DUMP_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no stack: {exc}"
    return (done.stdout + done.stderr).strip()


def engine_report(server: VllmServer) -> str:
    text = server.log_text()
    lines = text.splitlines()
    out = [f"== {server.name} ({server.url})"]
    key = [ln for ln in lines if any(m in ln for m in KEY_MARKS)][:20]
    out += key
    out += [ln for ln in lines if any(m in ln for m in LOG_MARKS) and ln not in key][-30:]
    if server.proc is None or server.proc.poll() is not None:
        out.append(f"{server.name}: its API server has exited")
        return "\n".join(out)
    for pid, title in sorted(server.processes().items()):
        out += [f"-- {title} (pid {pid})", stack(pid)]
    return "\n".join(out)


def coordinator_report(c: CoordinatorProcess) -> str:
    """A coordinator's state and its log's warnings, errors and leadership lines."""
    code = None if c.proc is None else c.proc.poll()
    state = "running" if code is None else f"exited with {code}"
    text = c.log_text()
    lines = [ln for ln in text.splitlines() if any(m in ln for m in COORD_MARKS)]
    # A stalled loop's threads (--hang-dump-s, which the tests set): what held it.
    return "\n".join([f"== coordinator {c.address} ({state})", *lines[-30:], *hang_dump(text)])


# A coordinator's lines worth a failed test's report: its warnings and errors
# (coordinator_stalled among them), tracebacks, and its leadership's changes.
COORD_MARKS = (*LOG_MARKS, "leader", "leadership")


def engines_report() -> str:
    """The report on every engine started and not stopped yet, and on every
    coordinator, where engines are ("" if no engine is). The session's
    reference engines (tests/support/reference.py) are no test's leftovers."""
    servers = [s for s in live_servers() if not s.name.startswith(REFERENCE_PREFIX)]
    if not servers:
        return ""
    parts = [engine_report(s) for s in servers]
    parts += [coordinator_report(c) for c in live_coordinators()]
    return "\n\n".join(parts)
