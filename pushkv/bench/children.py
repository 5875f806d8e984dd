"""The end of a benchmark's child processes."""

from __future__ import annotations

from collections.abc import Iterable
from multiprocessing.process import BaseProcess

KILLED_S = 5.0  # a killed process is reaped within this


def reap(procs: Iterable[BaseProcess], grace_s: float) -> None:
    """Wait up to `grace_s` for each process to end, then kill what still runs."""
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join(KILLED_S)
