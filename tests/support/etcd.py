"""A real etcd server for the tests (harness/etcd.py); skipped where etcd is absent."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from harness.etcd import ETCD, EtcdServer

__all__ = ["EtcdServer", "etcd"]


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    if not os.path.exists(ETCD):
        pytest.skip("etcd is not installed (scripts/setup.sh installs etcd-server)")
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()
