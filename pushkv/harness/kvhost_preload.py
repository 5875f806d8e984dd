"""What a KV host runs, loaded once by the KV hosts' fork server
(pushkv/harness/kvhost.py), so that a host forked from it starts without
loading any of it: numpy, gRPC, the agent, and NIXL, found as the agent finds
it (``NIXL_LOG_LEVEL`` defaulting to WARN first), with UCX's core library.
Importing this module loads NIXL: only the fork server imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

from pushkv.agent import nixl_boundary, placement, runtime
from pushkv.agent.nixl_types import NixlError
from pushkv.harness import kvhost
from pushkv.net import tls

__all__ = ["kvhost", "load", "placement", "runtime", "tls"]


def load() -> None:
    """NIXL, and UCX's core library: loading it calibrates the CPU clock, a
    busy loop of about 0.4 s of CPU here, in each process that loads it. It
    starts no thread and opens no context, so a fork after it is safe; the
    agent's UCX backend later finds it loaded. Without NIXL each host says so
    itself, when its agent starts."""
    try:
        api = nixl_boundary.nixl_api()
    except NixlError:
        return
    package = Path(api.__file__).resolve().parent
    for lib in sorted(package.parent.glob(f"{package.name}.libs/libucs-*.so*")):
        with contextlib.suppress(OSError):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


load()
