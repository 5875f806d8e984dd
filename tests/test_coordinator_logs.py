"""The coordinator's own log lines (controlplane/logs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a child process: logs.configure is process-wide (structlog caches
# its loggers), and the child's stderr is a stand-in that records each write.
_CHILD = """
import json, sys
class Recorder:
    writes = []
    def write(self, s):
        Recorder.writes.append(s)
        return len(s)
    def flush(self):
        pass
    def isatty(self):
        return False
real, sys.stderr = sys.stderr, Recorder()
from pushkv.controlplane import logs
import structlog
logs.configure("INFO")
structlog.get_logger("pushkv.coordinator").info("transfer_complete", transfer_id="t1")
structlog.get_logger("pushkv.coordinator").warning("coordinator_stalled", seconds=1.5)
print(json.dumps(Recorder.writes))
"""


def test_each_line_is_one_write() -> None:
    """Each line reaches stderr in one write, newline included, so that no
    other process sharing that stderr lands a line inside it (print() writes
    the newline apart, which with PYTHONUNBUFFERED is a write of its own: a
    CI run saw two JSON lines joined)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    writes = json.loads(done.stdout)
    assert len(writes) == 2, writes
    for w in writes:
        assert w.endswith("\n") and w.count("\n") == 1, w
    assert [json.loads(w)["event"] for w in writes] == ["transfer_complete", "coordinator_stalled"]
