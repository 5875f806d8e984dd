"""Fixtures shared by the test modules: an in-process coordinator (real gRPC
server, default settings) and a node relay in front of it. A module that
needs another coordinator (a child process, TLS, other settings) defines its
own `coord`, which takes precedence over this one. The tiny models and the
independent reference engines are built once per session. A failed test that left
vLLM engines running reports their logs' key lines and their stacks
(tests/support/failure_report.py). Each test gets the marker of its tier
(pure, process, vllm) from what it starts, and is held to it while it runs
(tests/support/tiers.py, tests/support/tier_guard.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
from pytest import TestReport

from pushkv.controlplane.server import Coordinator, ServerSettings, start
from pushkv.controlplane.settings import CoreSettings
from pushkv.harness.coordinator import COORD_HANG_DUMP_ENV
from pushkv.harness.tiny_model import build_tiny_mla_model, build_tiny_model
from pushkv.relay.server import Relay, RelaySettings
from tests.support import tier_guard
from tests.support.failure_report import engines_report
from tests.support.reference import ReferenceEngines

pytest_plugins = ["tests.support.tiers"]

# A coordinator child whose loop stalls 20 s writes its threads' stacks to
# its log, which a failed test's report prints (tests/support/serving.hang_dump).
os.environ.setdefault(COORD_HANG_DUMP_ENV, "20")


@pytest.fixture
async def coord() -> AsyncIterator[Coordinator]:
    c = await start(ServerSettings(port=0, core=CoreSettings()))
    yield c
    await c.stop(0)


@pytest.fixture
async def relay(coord: Coordinator) -> AsyncIterator[Relay]:
    r = await Relay(RelaySettings(coordinators=coord.address, listen="127.0.0.1:0")).start()
    yield r
    await r.stop()


# ------------------------------------------------ real vLLM: shared by the session
# Here, not in a module the tests import: a fixture imported into each module
# is one fixture per module, built again in each.


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (2 layers, hidden 128, vocab 1024), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_model_1kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with 1 KV head (4 attention heads): TP 2 replicates it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model_1kv"), kv_heads=1)


@pytest.fixture(scope="session")
def tiny_mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random DeepSeek-V2 (MLA: one 576-wide latent per token; 2 layers)."""
    return build_tiny_mla_model(tmp_path_factory.mktemp("tiny_mla_model"))


@pytest.fixture(scope="session")
def references() -> Iterator[ReferenceEngines]:
    """Independent engines with no connector, one per model, for the session
    (tests/support/reference.py)."""
    engines = ReferenceEngines()
    yield engines
    engines.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, TestReport, TestReport]:
    """A failed test (or setup) that left vLLM engines running reports their
    key log lines and every process's stack, taken before any fixture stops
    them: a hung request is then seen where it hangs."""
    report = yield
    if report.when in ("setup", "call") and report.failed:
        with tier_guard.exempt():  # py-spy, whatever the test's tier
            text = engines_report()
        if text:
            report.sections.append(("vLLM engines still running at the failure", text))
    return report
