"""A child process that runs another program, its pipes and its exit on the
running event loop: what `asyncio.create_subprocess_exec` gives, started
through Python's `subprocess` instead of the loop's own spawn.

Why: uvloop (the servers' loop) spawns with fork(), which in a process with
gRPC's threads running runs gRPC's fork handlers, and they write a plain
text line to stderr ("Other threads are currently calling into gRPC,
skipping fork() handlers") into the coordinator's JSON log, one per child.
`subprocess.Popen` execs through vfork(), so no fork handler runs, and no
copy of a large leader's page tables is made. The exit is read from a pidfd
(Linux 5.3), so no thread waits on it.

Ownership: the Child owns the Popen, the pipes' transports and the pidfd;
the pidfd is closed when the exit is seen, the pipes by the caller (stdin)
or at the child's end (stdout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Sequence


class Child:
    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: asyncio.WriteTransport | None,
        stdout: asyncio.StreamReader | None,
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, argv: Sequence[str], *, stdin: bool = False) -> Child:
        """Start `argv` with a pipe for its stdout (and its stdin if asked);
        its stderr is this process's."""
        loop = asyncio.get_running_loop()
        pipe = subprocess.PIPE
        # Blocks only until the child has exec'd (vfork): well under a millisecond.
        popen = subprocess.Popen(  # noqa: ASYNC220
            list(argv), stdin=pipe if stdin else None, stdout=pipe
        )
        try:
            assert popen.stdout is not None
            reader = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
            writer: asyncio.WriteTransport | None = None
            if popen.stdin is not None:
                writer, _ = await loop.connect_write_pipe(asyncio.Protocol, popen.stdin)
            return cls(popen, writer, reader)
        except BaseException:
            popen.kill()
            popen.wait()
            raise

    def _on_exit(self) -> None:
        """The pidfd is readable: the child ended (reaped here, at once)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        code = self._popen.wait()
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """Its exit code (negative: the signal that ended it)."""
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if not self._exited.done():  # reaped: its pid may be another's now
            self._popen.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
