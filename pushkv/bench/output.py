"""How the benchmarks print: lines written at once, and Markdown tables."""

from __future__ import annotations

import sys


def say(text: str = "") -> None:
    """One line on stdout, flushed (a long run shows its progress as it goes)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def table_head(*columns: str) -> list[str]:
    """A Markdown table's header line and rule line."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table_row(*cells: object) -> str:
    """A Markdown table row; each cell as ``str`` gives it."""
    return "| " + " | ".join(str(c) for c in cells) + " |"
