"""Where ``pushkv bench dataplane`` keeps its pools: host memory (numpy, NIXL
"DRAM") or GPU memory (torch on a CUDA device, NIXL "VRAM"), and the copy
each is measured against.

Both sides of a run use the same kind. A pool is a 2-D uint8 array (block,
byte) indexed the same way in either kind, so the timing and the checks are
written once. The memcpy baseline is one copy per run or slice in the
initiator's process, as the WRITE has one descriptor each, its addresses
computed from byte offsets as the WRITE's plan computes them: ``np.copyto``
on the host; on a GPU the driver's ``cuMemcpyDtoDAsync`` called directly (no
framework in between: vLLM's own ``swap_blocks`` copies a block per call the
same way), then one stream synchronisation, which the WRITE's completion
includes too. On a GPU a second reference is printed beside it: the same
blocks moved by torch indexing, one gather and one scatter kernel for all of
them (``kernel_copy``), which is what one process would use and no WRITE
across processes can be.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from pushkv.agent.nixl_types import MemoryKind

# A pool: np.ndarray (host) or torch.Tensor (GPU), shape (blocks, block_len), uint8.
Pool = Any

KINDS = ("dram", "vram")
# (destination offset, source offset, length) in bytes from each pool's start.
Runs = Sequence[tuple[int, int, int]]


class HostMemory:
    kind = MemoryKind.DRAM
    device_id = 0
    copy_name = "numpy copyto"

    def pool(self, blocks: int, block_len: int, fill: int) -> Pool:
        return np.full((blocks, block_len), fill, np.uint8)

    def pattern(self, blocks: int, block_len: int) -> Pool:
        """Block b holds the byte b % 251 (every page touched)."""
        pool = np.empty((blocks, block_len), np.uint8)
        pool[:] = (np.arange(blocks, dtype=np.uint32) % 251).astype(np.uint8)[:, None]
        return pool

    def addr(self, pool: Pool) -> int:
        return int(pool.ctypes.data)

    def copy_runs(self, dst: Pool, src: Pool, runs: Runs) -> None:
        d, s = dst.reshape(-1), src.reshape(-1)
        for do, so, n in runs:
            np.copyto(d[do : do + n], s[so : so + n])

    def done(self) -> None:
        """Every copy issued has landed (host copies are synchronous)."""

    def host(self, pool: Pool) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return np.asarray(pool)


class CudaMemory:
    kind = MemoryKind.VRAM
    copy_name = "cuMemcpyDtoDAsync per run, then one stream synchronize"

    def __init__(self, device_id: int = 0) -> None:
        try:
            import torch
        except ImportError as exc:
            raise SystemExit(f"--memory vram needs torch with CUDA: {exc}") from None
        if not torch.cuda.is_available():
            raise SystemExit(
                "--memory vram needs a CUDA device; torch "
                f"{torch.__version__} sees none (torch.cuda.is_available() is False)"
            )
        self._torch = torch
        self.device_id = device_id
        self._device = torch.device("cuda", device_id)
        torch.cuda.set_device(self._device)
        torch.cuda.init()  # the primary context, current on this thread for the driver calls
        libcuda = ctypes.CDLL("libcuda.so.1")
        self._memcpy = libcuda.cuMemcpyDtoDAsync_v2
        self._memcpy.argtypes = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
        self._memcpy.restype = ctypes.c_int
        self._sync = libcuda.cuStreamSynchronize
        self._sync.argtypes = (ctypes.c_void_p,)
        self._sync.restype = ctypes.c_int
        self._stream = ctypes.c_void_p(torch.cuda.current_stream(self._device).cuda_stream)

    def pool(self, blocks: int, block_len: int, fill: int) -> Pool:
        t = self._torch
        return t.full((blocks, block_len), fill, dtype=t.uint8, device=self._device)

    def pattern(self, blocks: int, block_len: int) -> Pool:
        t = self._torch
        column = (t.arange(blocks, device=self._device) % 251).to(t.uint8)[:, None]
        pool = column.expand(blocks, block_len).contiguous()
        t.cuda.synchronize(self._device)
        return pool

    def addr(self, pool: Pool) -> int:
        return int(pool.data_ptr())

    def copy_runs(self, dst: Pool, src: Pool, runs: Runs) -> None:
        db, sb, stream, memcpy = (
            int(dst.data_ptr()),
            int(src.data_ptr()),
            self._stream,
            self._memcpy,
        )
        for do, so, n in runs:
            if rc := memcpy(db + do, sb + so, n, stream):
                raise RuntimeError(f"cuMemcpyDtoDAsync failed: CUresult {rc}")

    def done(self) -> None:
        if rc := self._sync(self._stream):
            raise RuntimeError(f"cuStreamSynchronize failed: CUresult {rc}")

    def kernel_copy(
        self,
        dst: Pool,
        src: Pool,
        dst_blocks: Sequence[int],
        src_blocks: Sequence[int],
        dst_cols: tuple[int, int],
        src_cols: tuple[int, int],
    ) -> None:
        """dst[dst_blocks[i], dst_cols] = src[src_blocks[i], src_cols] for every i,
        by two kernels (the block ids go to the device first)."""
        t = self._torch
        di = t.tensor(dst_blocks, device=self._device)
        si = t.tensor(src_blocks, device=self._device)
        dst[di, dst_cols[0] : dst_cols[1]] = src[si, src_cols[0] : src_cols[1]]

    def host(self, pool: Pool) -> np.ndarray[Any, np.dtype[np.uint8]]:
        self.done()
        return np.asarray(pool.cpu().numpy())

    def name(self) -> str:
        return str(self._torch.cuda.get_device_name(self._device))


Memory = HostMemory | CudaMemory


def memory_for(kind: str) -> Memory:
    """The pools of ``--memory kind``; SystemExit with the reason if it cannot run here."""
    if kind == "dram":
        return HostMemory()
    if kind == "vram":
        return CudaMemory()
    raise SystemExit(f"--memory must be one of {', '.join(KINDS)}, not {kind!r}")


def describe(mem: Memory) -> str:
    if isinstance(mem, CudaMemory):
        return f"VRAM on cuda:{mem.device_id} ({mem.name()})"
    return "DRAM"
