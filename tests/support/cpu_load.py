"""Load on every core: one busy-loop process bound to each CPU this process
may use, bounded in time, for tests that show pushkv keeps working when the
machine's cores are all taken."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# Each loop ends by itself after this long, whatever becomes of the test.
SPIN_S = 600

SPIN = (
    "import os, time\n"
    "os.sched_setaffinity(0, {{{core}}})\n"
    "end = time.monotonic() + {s}\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


@contextmanager
def busy_cores(seconds: float = SPIN_S) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One spinning process per allowed core while the block runs; killed after."""
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN.format(core=core, s=seconds)])
        for core in sorted(os.sched_getaffinity(0))
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
