"""The harness's child processes own their files: a coordinator's folder (its
port file and default log) and a router's log outlive a stop, so that a failing
test can print the log, and are removed with the object that owns them (a
CI machine ran thousands of tests and kept thousands of such folders)."""

from __future__ import annotations

import gc

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import RouterProcess


def test_a_coordinator_folder_outlives_its_stop_and_goes_with_its_owner() -> None:
    coord = CoordinatorProcess().start()
    folder = coord._dir
    coord.stop()
    assert coord.log_text()  # readable after the stop
    assert folder.is_dir()
    del coord
    gc.collect()
    assert not folder.exists()


def test_a_router_log_goes_with_its_owner() -> None:
    router = RouterProcess("127.0.0.1:1")
    log = router.log_path
    assert log.is_file()
    del router
    gc.collect()
    assert not log.exists()
