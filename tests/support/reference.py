"""Independent reference engines, shared by the whole test session.

The end-to-end tests compare every output with an engine that has no KV
connector. Starting one per module cost a vLLM start each time (about 20-40 s
here); `ReferenceEngines` starts one per (model, settings) on first use, keeps
it for the session (idle between uses: no request, no compute) and remembers
each answer, so every module's references come from the same independent
engine. tests/conftest.py owns the one instance and stops its engines at the
session's end.
"""

from __future__ import annotations

from pathlib import Path

from pushkv.harness.vllm_server import VllmServer
from tests.support import serving

# Every reference engine's name starts so (a failed test's report leaves them out).
REFERENCE_PREFIX = "reference-shared-"


class ReferenceEngines:
    def __init__(self) -> None:
        self._servers: dict[tuple[str, int], VllmServer] = {}
        self._answers: dict[tuple[str, int, tuple[int, ...], int], str] = {}

    def server(self, model_dir: Path, *, block_size: int = 32) -> VllmServer:
        """The live reference engine of this model (started on first use,
        pinned with its OMP threads to core 0 like every reference here)."""
        key = (str(model_dir), block_size)
        if key not in self._servers:
            name = f"{REFERENCE_PREFIX}{model_dir.name}-bs{block_size}"
            ref = VllmServer(model_dir, name, cpu_core=0, block_size=block_size)
            assert ref.kv_transfer_config is None  # independent: no connector
            self._servers[key] = ref  # owned from here: stopped by close()
            ref.start().wait_ready()
        return self._servers[key]

    def outputs(
        self, model_dir: Path, prompts: list[list[int]], max_tokens: int, *, block_size: int = 32
    ) -> list[str]:
        """Greedy completions of `prompts`, one at a time (serving.one_by_one's
        checks: non-empty, not all equal), each computed once per session."""
        base = (str(model_dir), block_size)
        missing = [p for p in prompts if (*base, tuple(p), max_tokens) not in self._answers]
        if missing:
            url = self.server(model_dir, block_size=block_size).url
            for p in missing:
                self._answers[(*base, tuple(p), max_tokens)] = serving.completion(
                    url, p, max_tokens
                )
        out = [self._answers[(*base, tuple(p), max_tokens)] for p in prompts]
        assert all(out), f"reference produced an empty output: {out}"
        assert len(prompts) < 2 or len(set(out)) > 1, f"reference outputs all equal: {out[0]!r}"
        return out

    def close(self) -> None:
        for ref in self._servers.values():
            ref.stop()
        self._servers.clear()
