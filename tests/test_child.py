"""pushkv/net/child.py: a child process's pipes and exit on the event loop, on both
loops the servers run (uvloop, the default, and asyncio's own)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from pushkv.net.child import Child

DEADLINE_S = 30.0
# Says it is ready, echoes its stdin's lines until it ends, then exits 7.
ECHO = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "for line in sys.stdin:\n"
    "    print('got ' + line.strip(), flush=True)\n"
    "sys.exit(7)\n"
)


def _run(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(main(), DEADLINE_S)

    return uvloop.run(bounded()) if loop == "uvloop" else asyncio.run(bounded())


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_pipes_and_exit_code(loop: str) -> None:
    async def main() -> tuple[list[bytes], int, int | None]:
        child = await Child.start([sys.executable, "-c", ECHO], stdin=True)
        assert child.stdin is not None and child.stdout is not None
        assert child.returncode is None
        lines = [await child.stdout.readline()]
        child.stdin.write(b"one\n")
        lines.append(await child.stdout.readline())
        child.stdin.close()  # the child sees the end of its stdin and exits 7
        code = await child.wait()
        return lines, code, child.returncode

    lines, code, after = _run(loop, main)
    assert lines == [b"ready\n", b"got one\n"]
    assert code == 7 and after == 7


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_wait_given_up_leaves_the_exit_to_a_later_one_and_kill_ends_it(loop: str) -> None:
    async def main() -> tuple[int, int]:
        child = await Child.start([sys.executable, "-c", ECHO], stdin=True)
        assert child.stdout is not None
        assert await child.stdout.readline() == b"ready\n"
        with pytest.raises(TimeoutError):  # it waits on its stdin: no exit yet
            await asyncio.wait_for(child.wait(), 0.05)
        watcher = asyncio.get_running_loop().create_task(child.wait())
        child.kill()
        code = await child.wait()
        child.kill()  # ended and reaped: nothing is signalled
        return code, await watcher

    assert _run(loop, main) == (-signal.SIGKILL, -signal.SIGKILL)


def test_a_program_that_cannot_start_raises_at_start() -> None:
    async def main() -> None:
        await Child.start(["/nonexistent/pushkv-no-such-program"])

    with pytest.raises(FileNotFoundError):
        _run("uvloop", main)
