"""The port a server bound, written for whoever started it (`--port-file`)."""

from __future__ import annotations

from pathlib import Path


def write_port_file(path: str, port: int) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)  # atomic: readers never see a partial file
