"""The test-only hooks' parsing and their byte-level helpers
(vllm_integration/fault_hooks.py), on real buffers."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from pushkv.vllm_integration import fault_hooks as fh


def test_hooks_are_armed_together_with_commas() -> None:
    assert fh.parse_hooks("corrupt_kv:blocks=25,kv_digest") == {
        "corrupt_kv": "blocks=25",
        "kv_digest": "",
    }
    assert fh.parse_corrupt_kv("kv_digest,corrupt_kv:blocks=3") == 3
    assert fh.parse_corrupt_kv("kv_digest") is None
    assert fh.parse_hooks("") == {} and fh.parse_hooks(None) == {}


@pytest.mark.parametrize(
    ("value", "why"),
    [("corrupt_kv:blocks=0", "n >= 1"), ("corrupt_kv", "n >= 1"), ("kv_digets", "unknown hook")],
)
def test_a_misspelt_hook_is_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        fh.parse_corrupt_kv(value)


BLOCK = 64


def regions(n_blocks: int, fill: int) -> list[ctypes.Array[ctypes.c_char]]:
    """Two regions (say K and V of one layer) of n_blocks blocks each, every
    block of a byte of its own."""
    return [
        ctypes.create_string_buffer(
            b"".join(bytes([fill + 16 * i + b]) * BLOCK for b in range(n_blocks))
        )
        for i in range(2)
    ]


def addrs(bufs: list[ctypes.Array[ctypes.c_char]]) -> list[int]:
    return [ctypes.addressof(b) for b in bufs]


def test_the_digest_sees_equal_blocks_equal_and_one_changed_byte() -> None:
    src, dst = regions(4, 1), regions(8, 9)
    for i in range(2):  # "WRITE" src blocks 0, 2 into dst blocks 5, 7
        for s, d in ((0, 5), (2, 7)):
            ctypes.memmove(addrs(dst)[i] + d * BLOCK, addrs(src)[i] + s * BLOCK, BLOCK)
    sent = fh.blocks_digest(addrs(src), BLOCK, [0, 2])
    assert fh.blocks_digest(addrs(dst), BLOCK, [5, 7]) == sent
    assert fh.blocks_digest(addrs(dst), BLOCK, [7, 5]) != sent  # block order counts
    assert fh.blocks_digest(addrs(dst), BLOCK, [5, 6]) != sent
    assert fh.corrupt_blocks(addrs(dst)[1:], BLOCK, [7]) == BLOCK // 2
    assert fh.blocks_digest(addrs(dst), BLOCK, [5, 7]) != sent  # one region's block flipped


def test_hold_fire_waits_while_its_file_exists_and_gives_up_at_its_bound(tmp_path: Path) -> None:
    assert fh.parse_hooks(f"hold_fire:{tmp_path}/h") == {"hold_fire": f"{tmp_path}/h"}
    assert fh.hold_fire(None) == 0.0  # disarmed
    flag = tmp_path / "hold"
    assert fh.hold_fire(str(flag)) < 1.0  # no file: no hold
    flag.touch()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(fh.hold_fire, str(flag), 60.0)
        done, _ = wait([held], timeout=0.3)
        assert not done  # held while the file is there
        flag.unlink()
        assert held.result(timeout=10) >= 0.3
    flag.touch()
    assert fh.hold_fire(str(flag), 0.2) >= 0.2 and flag.exists()  # bounded: fires anyway


def test_the_hooks_load_only_where_a_test_arms_one() -> None:
    """Production processes never import the hooks module (faults.armed)."""
    import subprocess
    import sys

    probe = (
        "import sys; from pushkv.vllm_integration import faults, worker, scheduler; "
        "h = faults.armed(); "
        "print(h is not None, 'pushkv.vllm_integration.fault_hooks' in sys.modules)"
    )

    def run(env: dict[str, str]) -> str:
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return out.stdout.split("\n")[-2]

    assert run({}) == "False False"
    assert run({"PUSHKV_TEST_FAULT": "kv_digest"}) == "True True"
