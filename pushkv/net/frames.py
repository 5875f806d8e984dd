"""Length-prefixed protobuf frames on a byte stream (a Unix socket between a
leader's front and its partition processes: docs/reliability.md, "Past one
leader core"). Each frame is a 4-byte big-endian length and that many bytes
of one serialized message; never pickle."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

HEADER = struct.Struct(">I")
READ_CHUNK = 1 << 16
# The most one frame may hold: as gRPC's default message limit on the
# coordinator's streams, so a frame never carries what a stream could not.
MAX_FRAME = 4 << 20


class FrameError(ValueError):
    """A frame over MAX_FRAME: the stream is broken and must be closed."""


def take_frames(buf: bytearray, max_frame: int = MAX_FRAME) -> list[bytes]:
    """The whole frames at the head of `buf`, taken out of it; a frame not
    yet whole stays."""
    out, pos, n = [], 0, len(buf)
    while n - pos >= HEADER.size:
        (size,) = HEADER.unpack_from(buf, pos)
        if size > max_frame:
            raise FrameError(f"a frame of {size} bytes, over the {max_frame} allowed")
        if n - pos - HEADER.size < size:
            break
        start = pos + HEADER.size
        out.append(bytes(buf[start : start + size]))
        pos = start + size
    del buf[:pos]
    return out


def frame(data: bytes) -> bytes:
    """`data` as one frame."""
    if len(data) > MAX_FRAME:
        raise FrameError(f"a frame of {len(data)} bytes, over the {MAX_FRAME} allowed")
    return HEADER.pack(len(data)) + data


async def read_frames(reader: asyncio.StreamReader) -> AsyncIterator[list[bytes]]:
    """The frames of `reader`, as they come (each read's whole frames at once),
    until the stream ends. A partial frame at the end is dropped."""
    buf = bytearray()
    while chunk := await reader.read(READ_CHUNK):
        buf += chunk
        got = take_frames(buf)
        if got:
            yield got
