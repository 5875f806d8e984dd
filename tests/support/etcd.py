"""A real etcd server for the tests (pushkv/harness/etcd.py). Where etcd is absent the
tests skip on a developer's machine, and fail under CI (CI=true), where
scripts/setup.sh must have installed it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pushkv.harness.etcd import ETCD, EtcdServer

__all__ = ["EtcdServer", "etcd", "require_etcd"]


def require_etcd() -> None:
    if os.path.exists(ETCD):
        return
    why = f"etcd is not installed at {ETCD} (scripts/setup.sh installs etcd-server as root)"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    require_etcd()
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()
