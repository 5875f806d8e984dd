"""Entry point of a :class:`~harness.netlink.NetnsProcess` child.

``python -m pushkv.harness.netns_entry FD``: FD is the child's end of a socket pair;
the parent sends ``(module, function, args)`` over it, and this calls
``module.function(conn, *args)``.  Run through ``ip netns exec`` so the child
lives in a namespace, which multiprocessing's spawn cannot do.
"""

from __future__ import annotations

import importlib
import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    module, func, args = conn.recv()
    getattr(importlib.import_module(module), func)(conn, *args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
