"""The router's default flow, the first token from the prefill
(pushkv/router/seeded.py), in process against a real coordinator and the
stand-in engines of tests/test_router.py (HTTP surface only: no model runs,
no KV moves; tests/test_first_token_vllm.py runs real engines).

What is asserted: the client has token 1 before the decode leg is even sent;
the decode leg's body (the prompt's ids plus token 1, one token less,
prefill_tokens); one stream, one id, usage counted once; a request that ends
at token 1 cancels its transfer; max_tokens 1 begins none; a decode leg that
breaks after token 1 ends the stream with an error event, not silently; a
lost prefill leg is served by the decode engine alone.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from pushkv.harness.coordinator import CoordinatorProcess
from pushkv.v1 import pushkv_pb2 as pb
from tests.test_router import (
    CHAT,
    COMPLETIONS,
    FakeEngine,
    cluster,
    coord,
    prefill_500,
    sample,
    wait,
)

__all__ = ["coord"]  # the fixture, used by name


def routed(coord: CoordinatorProcess, *engines: Any, **settings: Any) -> Any:
    """tests/test_router.py's cluster, with the router's default flow."""
    return cluster(coord, *engines, first_token="prefill", **settings)


PROMPT_IDS = [11, 12, 13, 14, 15]
T1, T2, T3 = 101, 102, 103


def prefill_answer(body: dict[str, Any], chat: bool, finish: str = "length") -> dict[str, Any]:
    """A prefill engine's one-token answer, with return_token_ids as vLLM gives it."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [T1]}
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    out: dict[str, Any] = {"id": "cmpl-p", "created": 7, "model": "tiny", "usage": usage}
    if chat:
        choice["message"] = {"role": "assistant", "content": "A"}
        out |= {"object": "chat.completion", "prompt_token_ids": PROMPT_IDS}
    else:
        choice |= {"text": "A", "prompt_token_ids": PROMPT_IDS}
        choice["logprobs"] = {
            "tokens": ["A"],
            "token_logprobs": [-0.5],
            "top_logprobs": [{"A": -0.5}],
            "text_offset": [0],
        }
        out["object"] = "text_completion"
    out["choices"] = [choice]
    return out


def stop_gate() -> tuple[asyncio.Event, Any]:
    """A prefill engine that answers token 1, and an event set when it has."""
    answered = asyncio.Event()

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        answered.set()
        return web.json_response(prefill_answer(body, request.path == CHAT))

    return answered, prefill


def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
    event: dict[str, Any] = {"id": "cmpl-d", "object": "text_completion", "model": "tiny"}
    event["choices"] = [{"index": 0, "text": text, "finish_reason": finish}]
    return f"data: {json.dumps(event | extra)}\n\n".encode()


async def decode_stream(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(chunk("B"))
    await resp.write(chunk("C", "length"))
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
        event = {"id": "cmpl-d", "object": "text_completion", "choices": [], "usage": usage}
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def decode_json(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
    choice = {"index": 0, "text": "BC", "finish_reason": "length", "token_ids": [T2, T3]}
    choice["logprobs"] = {
        "tokens": ["B", "C"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"B": -0.1}, {"C": -0.2}],
        "text_offset": [0, 1],
    }
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    return web.json_response({"id": "cmpl-d", "choices": [choice], "usage": usage})


def events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def test_token_1_reaches_the_client_before_the_decode_leg_leaves(
    coord: CoordinatorProcess,
) -> None:
    release = asyncio.Event()

    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        await release.wait()  # the decode leg waits until the client holds token 1
        return await decode_stream(engine, request, body)

    async with routed(coord, stop_gate()[1], decode) as c:
        assert c.prefill is not None and c.decode is not None
        body = {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 3}
        body["stream_options"] = {"include_usage": True}
        async with c.http.post(c.url + COMPLETIONS, json=body) as resp:
            async with asyncio.timeout(10):
                first = await resp.content.readuntil(b"\n\n")
            assert events(first)[0]["choices"][0]["text"] == "A"
            release.set()
            rest = await resp.read()
        got = events(first + rest)
        assert [e["choices"][0]["text"] for e in got[:3]] == ["A", "B", "C"]
        assert {e["id"] for e in got[:-1]} == {"cmpl-p"}  # one stream, one id
        assert got[3]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        assert got[-1] == "[DONE]"

        p_leg, d_leg = c.prefill.legs[0], c.decode.legs[0]
        assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
        assert p_leg.body["return_token_ids"] is True
        tid = p_leg.body["kv_transfer_params"]["transfer_id"]
        assert d_leg.path == COMPLETIONS
        assert d_leg.body["prompt"] == [*PROMPT_IDS, T1]
        assert d_leg.body["max_tokens"] == 2
        assert d_leg.body["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "prefill_tokens": len(PROMPT_IDS),
        }
        assert "echo" not in d_leg.body


async def test_chat_is_one_chat_stream_and_a_stitched_answer(coord: CoordinatorProcess) -> None:
    async with routed(coord, stop_gate()[1], decode_stream) as c:
        assert c.decode is not None
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        body["max_completion_tokens"] = 3
        async with c.http.post(c.url + CHAT, json=body) as resp:
            got = events(await resp.read())
        assert got[0]["choices"][0]["delta"]["role"] == "assistant"
        deltas = [e["choices"][0]["delta"].get("content") for e in got[1:-1]]
        assert deltas == ["A", "B", "C"]
        assert {e["object"] for e in got[:-1]} == {"chat.completion.chunk"}
        assert got[-2]["choices"][0]["finish_reason"] == "length"
        d_body = c.decode.legs[0].body
        assert d_body["prompt"] == [*PROMPT_IDS, T1] and d_body["max_tokens"] == 2
        assert "messages" not in d_body and "max_completion_tokens" not in d_body

    async with routed(coord, stop_gate()[1], decode_json) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with c.http.post(c.url + CHAT, json=body) as resp:
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"] == "ABC"
        assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        assert "prompt_token_ids" not in answer and "token_ids" not in answer["choices"][0]


async def test_a_non_streamed_completion_is_stitched_with_its_logprobs(
    coord: CoordinatorProcess,
) -> None:
    async with routed(coord, stop_gate()[1], decode_json) as c:
        body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1, "return_token_ids": True}
        async with c.http.post(c.url + COMPLETIONS, json=body) as resp:
            answer = await resp.json()
        choice = answer["choices"][0]
        assert choice["text"] == "ABC" and choice["finish_reason"] == "length"
        assert choice["token_ids"] == [T1, T2, T3]
        assert choice["prompt_token_ids"] == PROMPT_IDS
        assert choice["logprobs"]["tokens"] == ["A", "B", "C"]
        assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.1, -0.2]
        assert choice["logprobs"]["text_offset"] == [0, 1, 2]
        assert answer["usage"]["completion_tokens"] == 3


async def test_a_request_that_ends_at_token_1_cancels_its_transfer(
    coord: CoordinatorProcess,
) -> None:
    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        return web.json_response(prefill_answer(body, False, finish="stop"))

    async with routed(coord, prefill, decode_stream) as c:
        assert c.prefill is not None and c.decode is not None
        body = {"prompt": "hi", "max_tokens": 8, "stream": True}
        async with c.http.post(c.url + COMPLETIONS, json=body) as resp:
            got = events(await resp.read())
        assert got[0]["choices"][0]["text"] == "A"
        assert got[0]["choices"][0]["finish_reason"] == "stop"
        assert got[-1] == "[DONE]"
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "ended at its first token" in t.detail
        assert c.decode.legs == []  # no decode leg at all


async def test_max_tokens_1_is_the_prefill_engine_alone(coord: CoordinatorProcess) -> None:
    async with routed(coord, stop_gate()[1], decode_stream) as c:
        assert c.prefill is not None and c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}) as r:
            answer = await r.json()
        assert answer["choices"][0]["text"] == "A"
        assert "kv_transfer_params" not in c.prefill.legs[0].body
        assert c.decode.legs == []
        listed = await c.status.ListTransfers(pb.ListTransfersRequest(limit=10), timeout=5)
        assert list(listed.transfers) == []  # no transfer was begun


async def test_a_decode_leg_that_breaks_after_token_1_ends_the_stream_with_an_error(
    coord: CoordinatorProcess,
) -> None:
    async def decode(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("B"))
        request.transport.close()  # type: ignore[union-attr]  # the engine dies mid-stream
        return resp

    async with routed(coord, stop_gate()[1], decode) as c:
        assert c.prefill is not None
        body = {"prompt": "hi", "max_tokens": 8, "stream": True}
        async with c.http.post(c.url + COMPLETIONS, json=body) as resp:
            assert resp.status == 200  # sent with token 1
            got = events(await resp.read())
        assert [e["choices"][0]["text"] for e in got[:2]] == ["A", "B"]
        assert got[-1]["error"]["code"] == 502  # an error event, and no [DONE]
        assert "failed after the first token" in got[-1]["error"]["message"]
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)


async def test_a_lost_prefill_leg_is_served_by_the_decode_engine_alone(
    coord: CoordinatorProcess,
) -> None:
    async with routed(coord, prefill_500, decode_json) as c:
        assert c.prefill is not None and c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200
            answer = await r.json()
        assert answer["choices"][0]["text"] == "BC"  # the decode engine's whole answer
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "prefill leg failed" in t.detail and t.detail.endswith("(decode recomputes)")
        assert "kv_transfer_params" not in c.decode.legs[0].body
        assert sample(c, "pushkv_router_fallbacks_total", reason="prefill_failed") == 1

    async with routed(coord, prefill_500, decode_json, on_transfer_failure="fail") as c:
        assert c.decode is not None
        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 502
            assert (await r.json())["error"]["stage"] == "prefill_failed"
        assert c.decode.legs == []


async def test_requests_it_cannot_seed_keep_both_legs_at_once(coord: CoordinatorProcess) -> None:
    """Structured output (and tools, echo, chat logprobs) keep the concurrent
    flow: the decode engine answers every token. n > 1 goes to the decode
    engine alone, with no transfer (several sequences would each report it)."""
    answered, prefill = stop_gate()
    async with routed(coord, prefill, decode_json) as c:
        assert c.prefill is not None and c.decode is not None
        body = {"prompt": "hi", "response_format": {"type": "json_object"}}
        async with c.http.post(c.url + COMPLETIONS, json=body) as r:
            assert r.status == 200
        d_leg = c.decode.legs[0]
        assert set(d_leg.body["kv_transfer_params"]) == {"do_remote_prefill", "transfer_id"}
        assert d_leg.body["prompt"] == "hi"
        await wait(answered, "prefill leg")

        async with c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "n": 2}) as r:
            assert r.status == 200
        assert "kv_transfer_params" not in c.decode.legs[1].body
        assert len(c.prefill.legs) == 1  # none for n = 2
        assert sample(c, "pushkv_router_fallbacks_total", reason="several_sequences") == 1


async def test_a_prefill_engine_that_hangs_is_given_up_when_the_coordinator_drops_it(
    coord: CoordinatorProcess,
) -> None:
    """The prefill engine never answers and its agent goes away (its lease
    ends): the router gives the leg up at its next refreshes of the engine
    list and the decode engine serves the request alone (no decode leg
    existed yet to fall back from)."""
    never = asyncio.Event()

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        await never.wait()
        raise AssertionError("unreachable")

    async with routed(coord, prefill, decode_json, refresh_s=0.2) as c:
        assert c.prefill is not None and c.decode is not None
        post = asyncio.ensure_future(
            c.http.post(c.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 3})
        )
        await wait(c.prefill.arrived, "prefill leg")
        await c.agents[0].close()  # the prefill engine's agent: the coordinator drops it
        async with asyncio.timeout(10):
            resp = await post
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == "BC"  # the decode engine's
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        t = await c.wait_transfer(tid, pb.TRANSFER_STATE_CANCELLED)
        assert "no longer listed by the coordinator" in t.detail
        await wait(c.prefill.closed, "prefill leg cut off")


async def test_a_first_token_that_is_not_whole_text_is_answered_by_the_decode_engine(
    coord: CoordinatorProcess,
) -> None:
    """Token 1 is part of a multi-byte character (vLLM withholds its text):
    nothing is sent from the prefill, and the decode leg is the client's whole
    request (the decode engine answers from token 1, its KV pushed all the same)."""

    async def prefill(engine: FakeEngine, request: web.Request, body: dict[str, Any]) -> Any:
        answer = prefill_answer(body, False)
        answer["choices"][0]["text"] = ""
        return web.json_response(answer)

    async with routed(coord, prefill, decode_stream) as c:
        assert c.prefill is not None and c.decode is not None
        body = {"prompt": "hi", "max_tokens": 3, "stream": True}
        async with c.http.post(c.url + COMPLETIONS, json=body) as resp:
            got = events(await resp.read())
        assert [e["choices"][0]["text"] for e in got[:-1]] == ["B", "C"]  # the decode's alone
        d_leg = c.decode.legs[0]
        tid = c.prefill.legs[0].body["kv_transfer_params"]["transfer_id"]
        assert d_leg.body["prompt"] == "hi" and d_leg.body["max_tokens"] == 3
        assert d_leg.body["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": tid}
        assert sample(c, "pushkv_router_fallbacks_total", reason="first_token_not_whole") == 1
