"""The compiled core is used only when it is a build of today's sources."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import controlplane
from controlplane import _native, rendezvous


def _fake_build(pkg: Path) -> Path:
    """A package dir whose .native/ claims to be a build of its sources."""
    native = pkg / _native.DIRNAME
    (native / "controlplane").mkdir(parents=True)
    sources = {}
    for mod in _native.MODULES:
        src = pkg / f"{mod}.py"
        src.write_text(f"NAME = {mod!r}\n")
        sources[mod] = _native.source_hash(src)
        (native / "controlplane" / f"{mod}{_native.abi_tag()}").write_bytes(b"")
    manifest = {"abi": _native.abi_tag(), "sources": sources}
    (native / _native.MANIFEST).write_text(json.dumps(manifest))
    return native


def test_this_process_runs_the_build_its_environment_asks_for() -> None:
    compiled = rendezvous.__file__.endswith(_native.abi_tag())
    assert controlplane.NATIVE.compiled is compiled
    if os.environ.get(_native.ENV) == "1":  # scripts/test.sh: the suite runs compiled
        assert compiled, controlplane.NATIVE.detail


def test_a_fresh_build_goes_first_and_an_edited_source_retires_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    native = _fake_build(tmp_path)
    monkeypatch.setenv(_native.ENV, "auto")
    path = [str(tmp_path)]
    assert _native.activate(path).compiled
    assert path == [str(native / "controlplane"), str(tmp_path)]
    assert str(native) not in sys.path  # see test_a_spawned_child_imports_this_package

    (tmp_path / "rendezvous.py").write_text("NAME = 'edited'\n")
    path = [str(tmp_path)]
    state = _native.activate(path)
    assert not state.compiled and "rendezvous.py changed" in state.detail
    assert path == [str(tmp_path)]
    monkeypatch.setenv(_native.ENV, "1")
    with pytest.raises(ImportError, match=r"rendezvous\.py changed"):
        _native.activate([str(tmp_path)])


def test_missing_foreign_or_disabled_builds_are_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "not built" in _native.check(tmp_path).detail
    native = _fake_build(tmp_path)
    manifest = json.loads((native / _native.MANIFEST).read_text())
    (native / _native.MANIFEST).write_text(json.dumps({**manifest, "abi": ".cpython-39-x.so"}))
    assert "built for .cpython-39-x.so" in _native.check(tmp_path).detail
    (native / _native.MANIFEST).write_text("{not json")
    assert "unreadable" in _native.check(tmp_path).detail
    (native / _native.MANIFEST).write_text(json.dumps(manifest))
    next((native / "controlplane").glob("transfer.*")).unlink()
    assert "transfer missing" in _native.check(tmp_path).detail

    _fake_build(tmp_path / "again")
    monkeypatch.setenv(_native.ENV, "0")
    path = [str(tmp_path / "again")]
    assert _native.activate(path) == (False, f"{_native.ENV}=0")
    assert path == [str(tmp_path / "again")]
    monkeypatch.setenv(_native.ENV, "yes")
    with pytest.raises(ImportError, match="expected auto, 0 or 1"):
        _native.activate(path)


def _python(
    code: str, *, env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter; its output, not raised on failure."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_pushkv_native_0_imports_the_sources() -> None:
    code = "import controlplane.rendezvous as r, controlplane as c; print(r.__file__, c.NATIVE)"
    env = {**os.environ, _native.ENV: "0"}
    out = _python(code, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0].endswith("controlplane/rendezvous.py")


def test_a_spawned_child_imports_this_package(tmp_path: Path) -> None:
    """A process started by the console script (repo not first on sys.path) that
    spawns a child: the child inherits sys.path and must still import this
    package, with its compiled core (`pushkv bench coordinator` does this)."""
    code = (
        "import multiprocessing as mp, controlplane\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        pool.apply(exec, ('import controlplane.metrics',))\n"
        "    print(controlplane.NATIVE.compiled)\n"
    )
    script = tmp_path / "spawner.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(controlplane.NATIVE.compiled)


def test_a_copy_of_the_package_compiles_and_runs_compiled(tmp_path: Path) -> None:
    """As for an installed (non-editable) copy: no project config beside it."""
    pkg = tmp_path / "controlplane"
    shutil.copytree(
        Path(controlplane.__file__).parent, pkg, ignore=shutil.ignore_patterns(".native*")
    )
    env = {**os.environ, _native.ENV: "0"}
    build = (
        "from pathlib import Path; from controlplane import native_build; "
        f"print(native_build.build(Path({str(pkg)!r})))"
    )
    out = _python(build, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _native.check(pkg).compiled
    use = (
        "import controlplane.rendezvous as r; from controlplane.clock import SystemClock; "
        "from controlplane.settings import CoreSettings; "
        "rv = r.Rendezvous(CoreSettings(), SystemClock()); t, _ = rv.cancel('x', 'test'); "
        "print(r.__file__, t.state.value)"
    )
    out = _python(use, env={**os.environ, _native.ENV: "1"}, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    path, state = out.stdout.split()
    assert path.startswith(str(pkg / _native.DIRNAME)) and state == "cancelled"


async def test_the_coordinator_logs_which_core_it_runs() -> None:
    from structlog.testing import capture_logs

    from controlplane.server import ServerSettings, start

    with capture_logs() as logs:
        coord = await start(ServerSettings(port=0))
        await coord.stop(0)
    started = [e for e in logs if e["event"] == "coordinator_started"]
    assert started and started[0]["core"] == (
        "compiled" if controlplane.NATIVE.compiled else "python"
    )
