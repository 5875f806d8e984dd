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

from harness.vllm_server import VllmServer, live_servers
from tests.support.serving import KEY_MARKS, LOG_MARKS

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


def engines_report() -> str:
    """The report on every engine started and not stopped yet ("" if none)."""
    return "\n\n".join(engine_report(s) for s in live_servers())
