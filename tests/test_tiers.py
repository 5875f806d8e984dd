"""The test tiers (tests/support/tiers.py, tests/support/tier_guard.py): each
test's tier detected from what its code and fixtures name, the marker `-m`
selects on, a hand-stated tier refused above the detected one, and a test
that starts more than its tier allows failed while it runs, even when it
hides how (an import by string) or catches the refusal. Each check runs
pytest with the tiers plugin on a generated test file, in a child process."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import vllm.config

REPO = Path(__file__).resolve().parent.parent

CLASSIFIED = """
import subprocess

import pytest

from pushkv.controlplane.server import ServerSettings, start
from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.vllm_server import VllmServer
from tests.conftest import tiny_model_dir  # noqa: F401
from tests.support.vllm_harness import make_vllm_config


def _inner():
    return subprocess.run


def _outer():
    return _inner()


class _Starter:
    def go(self):
        return CoordinatorProcess


@pytest.fixture
def in_process():
    return start


@pytest.fixture
def a_coordinator_process():
    return CoordinatorProcess


@pytest.fixture
def layered(a_coordinator_process):
    return a_coordinator_process


def test_pure(in_process):
    assert in_process


def test_process_through_helpers():
    _outer()


def test_process_through_a_class():
    _Starter().go()


def test_process_through_a_fixture_of_a_fixture(layered):
    pass


def test_process_by_setting():
    ServerSettings(port=0, partition_procs=2)


@pytest.mark.parametrize("f", [_outer])
def test_process_by_parameter(f):
    pass


def test_vllm_by_fixture(tiny_model_dir):
    pass


def test_vllm_by_server():
    VllmServer


def test_vllm_by_harness():
    make_vllm_config


@pytest.mark.process
def test_lowered_by_hand():
    VllmServer
"""

EXPECTED = {
    "test_pure": "pure",
    "test_process_through_helpers": "process",
    "test_process_through_a_class": "process",
    "test_process_through_a_fixture_of_a_fixture": "process",
    "test_process_by_setting": "process",
    "test_process_by_parameter[_outer]": "process",
    "test_vllm_by_fixture": "vllm",
    "test_vllm_by_server": "vllm",
    "test_vllm_by_harness": "vllm",
    "test_lowered_by_hand": "process",
}

# Each starts through a name that detection cannot read (an import by string).
ENFORCED = """
import importlib
import subprocess
import sys

import pytest


def _hidden(module, name):
    return getattr(importlib.import_module(module), name)


def test_pure_starts_a_process():
    _hidden("subprocess", "run")([sys.executable, "-c", "pass"], check=True)


def test_pure_catches_the_refusal():
    try:
        _hidden("subprocess", "run")([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass


async def test_pure_starts_an_asyncio_child():
    child = await _hidden("asyncio", "create_subprocess_exec")(sys.executable, "-c", "pass")
    await child.wait()


def test_pure_starts_a_multiprocessing_child():
    child = _hidden("multiprocessing", "get_context")("spawn").Process(target=print)
    child.start()
    child.join(30)


@pytest.mark.pure
def test_marked_pure_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_process_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_process_starts_a_vllm_server(tmp_path):
    assert subprocess
    _hidden("pushkv.harness.vllm_server", "VllmServer")(tmp_path, "hidden").start()


def test_process_runs_vllm():
    subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "-h"], check=True)
"""

OUTCOMES = {
    "test_pure_starts_a_process": ("pure", "starts a child process"),
    "test_pure_catches_the_refusal": ("pure", "starts a child process"),
    "test_pure_starts_an_asyncio_child": ("pure", "starts a child process"),
    "test_pure_starts_a_multiprocessing_child": ("pure", "starts a child process (multiprocessing"),
    "test_marked_pure_starts_a_process": ("pure", "starts a child process"),
    "test_process_starts_a_process": None,  # passes
    "test_process_starts_a_vllm_server": ("process", "starts a vLLM server"),
    "test_process_runs_vllm": ("process", "starts a vLLM engine"),
}


def _pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_generated.py").write_text(source)
    cmd = [
        sys.executable, "-m", "pytest", "-p", "tests.support.tiers", "-p", "no:cacheprovider",
        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), *args,
        str(tmp_path / "test_generated.py"),
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, check=False, capture_output=True, text=True, timeout=240)


def test_each_test_gets_the_tier_of_what_it_names_and_the_marker(tmp_path: Path) -> None:
    run = _pytest(tmp_path, CLASSIFIED, "--collect-only", "-q", "--tiers", "-m", "not vllm")
    assert run.returncode == 0, run.stdout + run.stderr
    tiers: dict[str, str] = {}
    selected: set[str] = set()
    for line in run.stdout.splitlines():
        tier, _, rest = line.partition(" ")
        if tier in ("pure", "process", "vllm"):
            tiers[rest.split()[0].split("::")[1]] = tier
        elif line.startswith("test_generated.py::"):
            selected.add(line.split("::")[1])
    assert tiers == EXPECTED, run.stdout
    # -m selects on the markers: the hand-lowered one by its stated tier.
    assert selected == {name for name, tier in EXPECTED.items() if tier != "vllm"}
    assert "marked process (detected: names pushkv.harness.vllm_server.VllmServer" in run.stdout


def test_a_tier_marker_above_the_detected_tier_fails_collection(tmp_path: Path) -> None:
    source = "import pytest\n\n\n@pytest.mark.vllm\ndef test_raised_by_hand():\n    pass\n"
    run = _pytest(tmp_path, source, "--collect-only", "-q")
    assert run.returncode == 4, run.stdout + run.stderr  # a usage error
    assert "a tier marker may only lower the detected tier" in run.stderr
    assert "test_raised_by_hand: marked vllm, detected pure" in run.stderr


def test_a_test_that_starts_more_than_its_tier_fails_with_the_rule(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    run = _pytest(tmp_path, ENFORCED, "-q", f"--junitxml={junit}")
    assert run.returncode == 1, run.stdout + run.stderr
    got: dict[str, str | None] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        got[case.attrib["name"]] = None if failure is None else failure.attrib["message"]
    assert set(got) == set(OUTCOMES), run.stdout
    for name, expected in OUTCOMES.items():
        message = got[name]
        if expected is None:
            assert message is None, f"{name}: {message}"
            continue
        tier, what = expected
        assert message is not None, f"{name} passed"
        assert f"is in the `{tier}` tier" in message, f"{name}: {message}"
        assert what in message, f"{name}: {message}"
        assert "tier rule broken" in message


def test_vllms_config_is_held_to_the_rule_once_vllm_loads_it() -> None:
    """VllmConfig, what every vLLM engine object built in-process needs, is
    guarded as its module loads (an import hook), or at once if loaded. (vLLM
    is imported with this module: its import runs `uname`, a child process.)"""
    assert getattr(vllm.config.VllmConfig.__init__, "tier_guard", False)
