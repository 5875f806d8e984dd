"""`pushkv bench dataplane` runs end to end on real NIXL between two real
processes: whole blocks and head slices, each ending with a WRITE the target
checks byte for byte (a mismatch raises). No figure is asserted. GPU memory
(`--memory vram`) runs where torch sees a CUDA device and is refused with the
reason where it does not."""

from __future__ import annotations

import re

import pytest
import torch

from pushkv.agent.nixl_adapter import quiet_nixl_env
from pushkv.bench import dataplane
from pushkv.bench.dataplane_memory import HostMemory, memory_for

# One repetition of 1, 8 and 64 blocks of 128 KiB: the goal's combination.
SHORT = ["--quick", "--block-kib", "128", "--reps", "1"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench sets NIXL's quiet loopback environment only where unset: set
    here, it is undone after each test instead of staying in the process."""
    for key, value in quiet_nixl_env(loopback=True).items():
        monkeypatch.setenv(key, value)


def test_whole_blocks_land_and_the_goal_line_is_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert dataplane.main(SHORT) == 0
    out = capsys.readouterr().out
    assert "of DRAM vs numpy copyto" in out
    assert re.search(r"^write_vs_memcpy_64x128KiB_scattered=\d+\.\d\d contiguous=", out, re.M)


def test_head_slices_land_in_both_directions(capsys: pytest.CaptureFixture[str]) -> None:
    assert dataplane.main([*SHORT, "--sliced"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"^sliced_write_vs_memcpy_64x128KiB (.*)$", out, re.M)
    assert line is not None
    keys = {kv.split("=")[0] for kv in line.group(1).split()}
    assert keys == {"1->2_cont", "1->2_scat", "2->1_cont", "2->1_scat"}


def test_host_memory_copies_runs_by_byte_offset() -> None:
    mem = HostMemory()
    src, dst = mem.pattern(4, 8), mem.pool(4, 8, 0xEE)
    mem.copy_runs(dst, src, [(1 * 8 + 4, 2 * 8, 4), (3 * 8, 0, 8)])
    mem.done()
    assert list(dst[1]) == [0xEE] * 4 + [2] * 4
    assert list(dst[3]) == [0] * 8
    assert list(dst[0]) == [0xEE] * 8 and list(dst[2]) == [0xEE] * 8


def test_gpu_memory_runs_or_is_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        assert dataplane.main([*SHORT, "--memory", "vram", "--sliced"]) == 0
        assert "write_vs_kernel_64x128KiB" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        memory_for("vram")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        dataplane.main([*SHORT, "--memory", "vram"])


def test_gpu_memory_refuses_the_host_only_modes(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--cma-floor", "--resized"):
        with pytest.raises(SystemExit) as exc:
            dataplane.main(["--memory", "vram", flag])
        assert exc.value.code == 2
        assert "--memory vram runs whole blocks or --sliced on one host only" in (
            capsys.readouterr().err
        )
