"""The first token from the prefill (pure shaping, no I/O): which requests can
take it, the two legs' bodies, and the client's answer stitched from both.

The prefill leg runs with max_tokens 1 and samples the request's first token;
the router answers the client with it at once (TTFT is the prefill's own time
plus one hop). The decode leg then goes to the decode engine's
/v1/completions with the prompt's token ids plus that token as its prompt and
`prefill_tokens` (the prompt's length) in its kv_transfer_params: the decode
side registers blocks for the prompt only, the prefill pushes them as before,
and the decode engine computes the one new position itself and samples from
token 2 on. It never samples token 1 again.

What holds, as measured by tests/test_first_token_vllm.py: greedy outputs
equal a single engine's, for completions and chat, streamed or not; usage
counts the prompt once and every completion token once. Sampled requests:
token 1 follows the request's seed on the prefill engine; tokens 2.. draw from
the decode engine's generator seeded the same way but one draw behind a single
engine's, so a seeded request is reproducible on pushkv but not equal to a
single engine's sample. Presence and frequency penalties see token 1 as part
of the decode leg's prompt, not as output (repetition_penalty sees it either
way); a stop string that spans tokens 1 and 2 is not caught.

A first token that is not whole text (part of a multi-byte character, or a
skipped special token: `FirstToken.whole`) is not sent: the decode engine
answers the request from token 1, its KV pushed as before.

Requests this cannot serve keep the first token from the decode engine
(`reason_not_seeded` says why; n > 1, best_of and beam search are served by
the decode engine alone, with no transfer, in either flow): several prompts
in one request, suffix, echo (vLLM leaves an echoed prompt undetokenized when
the prefill asks for token ids), structured output or tools (the decode
engine must parse from token 1), and chat with logprobs.
"""

from __future__ import annotations

import copy
import json
from typing import Any

# Chat fields the decode leg (a /v1/completions request) carries as they are:
# sampling and output settings common to both endpoints. A chat field not
# here either builds the prompt (the prefill did that) or is refused below.
_CHAT_TO_COMPLETION = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "user",
    "priority",
    "stream",
    "stream_options",
    "return_token_ids",
    "vllm_xargs",
)
# Present (and not null/false/empty), each keeps the first token on the decode engine.
_NOT_SEEDED = {
    "n": "n > 1",
    "best_of": "best_of",
    "use_beam_search": "beam search",
    "suffix": "suffix",
    "response_format": "structured output",
    "structured_outputs": "structured output",
    "guided_json": "structured output",
    "guided_regex": "structured output",
    "guided_choice": "structured output",
    "guided_grammar": "structured output",
    "tools": "tools",
    "prompt_logprobs": "prompt_logprobs",
    # vLLM does not detokenize an echoed prompt given return_token_ids
    "echo": "echo",
}
_CHAT_NOT_SEEDED = {"logprobs": "chat logprobs", "top_logprobs": "chat logprobs"}


def several_sequences(body: dict[str, Any]) -> bool:
    """n > 1, best_of > 1 or beam search: several sequences under one request
    id. The router serves them from the decode engine alone, no transfer."""
    return any(
        isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > 1
        for k in ("n", "best_of")
    ) or bool(body.get("use_beam_search"))


def reason_not_seeded(body: dict[str, Any], chat: bool) -> str:
    """Why this request keeps its first token on the decode engine, or "" if
    the prefill's can be used."""
    for key, why in _NOT_SEEDED.items():
        value = body.get(key)
        if key in ("n", "best_of") and value in (None, 1):
            continue
        if value not in (None, False, [], {}, ""):
            return why
    if chat:
        for key, why in _CHAT_NOT_SEEDED.items():
            if body.get(key) not in (None, False, 0):
                return why
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return "several prompts"
    return ""


def max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """The request's token budget: None means the engine's default for chat
    (up to the context length); completions default to 16, as vLLM's."""
    if chat:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
        return int(value) if value else None
    value = body.get("max_tokens", 16)
    return None if value is None else int(value)


def prefill_body(body: dict[str, Any], chat: bool, transfer_id: str | None) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, with the prompt's token ids in
    the answer. Without a transfer id (max_tokens 1) it is the whole request."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if chat:
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    out["return_token_ids"] = True
    if transfer_id is not None:
        out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


class FirstToken:
    """What the prefill's answer says: its token, the prompt's ids, its text."""

    def __init__(self, answer: dict[str, Any], chat: bool) -> None:
        choice = answer["choices"][0]
        ids = choice.get("token_ids")
        prompt = answer.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
        if not ids or not prompt:
            raise ValueError("the prefill's answer has no token_ids/prompt_token_ids")
        self.answer = answer
        self.token: int = int(ids[0])
        self.prompt_ids: list[int] = [int(t) for t in prompt]
        self.text: str = (
            str(choice["message"].get("content") or "") if chat else str(choice.get("text", ""))
        )
        self.finish_reason: str | None = choice.get("finish_reason")
        self.stop_reason: Any = choice.get("stop_reason")
        self.logprobs: Any = choice.get("logprobs")

    @property
    def whole(self) -> bool:
        """Token 1 is whole text. It is not when it is part of a multi-byte
        character (vLLM withholds it: empty text, or a trailing U+FFFD) or a
        skipped special token: then a prompt ending in it does not detokenize
        as a single engine's output does (vLLM's incremental detokenizer
        repeats prompt text), so the decode engine answers from token 1."""
        return bool(self.text) and not self.text.endswith("\ufffd")

    def finished(self, budget: int | None) -> bool:
        """Token 1 ends the request: a stop token or string, or a budget of one."""
        return self.finish_reason == "stop" or budget == 1


def decode_body(
    body: dict[str, Any], chat: bool, transfer_id: str, first: FirstToken, budget: int | None
) -> dict[str, Any]:
    """The decode leg, a /v1/completions request: the prompt's ids and token 1
    as its prompt, one token less to generate."""
    if chat:
        out = {k: body[k] for k in _CHAT_TO_COMPLETION if k in body}
    else:
        out = {k: v for k, v in body.items() if k not in ("prompt", "echo", "max_tokens")}
    out["prompt"] = [*first.prompt_ids, first.token]
    out["max_tokens"] = None if budget is None else budget - 1
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - 1)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "prefill_tokens": len(first.prompt_ids),
    }
    return out


def _fix_usage(usage: Any) -> Any:
    """The decode leg's usage, counted as the client's request: token 1 is a
    completion token, not a prompt token."""
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        usage = dict(usage)
        usage["prompt_tokens"] -= 1
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + 1
    return usage


def _keep_ids(choice: dict[str, Any], want: bool) -> None:
    if not want:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)


def first_only(first: FirstToken, body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The whole answer when token 1 ends the request (non-streamed shape)."""
    out = copy.deepcopy(first.answer)
    if not body.get("return_token_ids"):
        out.pop("prompt_token_ids", None)
        for c in out.get("choices", ()):
            _keep_ids(c, False)
    return out


def first_chunks(first: FirstToken, body: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """The stream's first events: token 1 (for chat, the role first)."""
    a = first.answer
    head = {"id": a.get("id"), "created": a.get("created"), "model": a.get("model")}
    want_ids = bool(body.get("return_token_ids"))
    if chat:
        head["object"] = "chat.completion.chunk"
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": first.text},
            "logprobs": None,
            "finish_reason": None,
        }
        if want_ids:
            choice["token_ids"] = [first.token]
        role_chunk = {**head, "choices": [role]}
        if want_ids:
            role_chunk["prompt_token_ids"] = first.prompt_ids
        return [role_chunk, {**head, "choices": [choice]}]
    head["object"] = "text_completion"
    choice = {"index": 0, "text": first.text, "logprobs": first.logprobs, "finish_reason": None}
    if want_ids:
        choice["token_ids"] = [first.token]
        choice["prompt_token_ids"] = first.prompt_ids
    return [{**head, "choices": [choice]}]


def decode_chunk(event: dict[str, Any], first: FirstToken, chat: bool) -> dict[str, Any]:
    """One streamed event of the decode leg, as the client's stream goes on:
    the prefill's id, usage counted for the client's request, chat shape for chat."""
    event["id"] = first.answer.get("id")
    if "usage" in event and event["usage"] is not None:
        event["usage"] = _fix_usage(event["usage"])
    for c in event.get("choices") or ():
        c.pop("prompt_token_ids", None)
    if not chat:
        return event
    event["object"] = "chat.completion.chunk"
    event["choices"] = [
        {
            "index": c.get("index", 0),
            "delta": {"content": c.get("text", "")},
            "logprobs": None,
            "finish_reason": c.get("finish_reason"),
            "stop_reason": c.get("stop_reason"),
            **({"token_ids": c["token_ids"]} if "token_ids" in c else {}),
        }
        for c in event.get("choices") or ()
    ]
    return event


def _merge_logprobs(first: Any, rest: Any, shift: int) -> Any:
    """Completions logprobs of token 1 and of the decode's tokens, as one;
    the decode's text offsets move past token 1's text."""
    if not isinstance(first, dict) or not isinstance(rest, dict):
        return first or rest
    out = {}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        out[key] = list(first.get(key) or []) + list(rest.get(key) or [])
    out["text_offset"] = list(first.get("text_offset") or []) + [
        o + shift for o in rest.get("text_offset") or []
    ]
    return out


def stitched(
    first: FirstToken, rest: dict[str, Any], body: dict[str, Any], chat: bool
) -> dict[str, Any]:
    """The non-streamed answer: token 1's and the decode's, as one request's."""
    out = copy.deepcopy(first.answer)
    d = rest["choices"][0]
    c = out["choices"][0]
    text = first.text + str(d.get("text", ""))
    if chat:
        c["message"]["content"] = text
    else:
        c["logprobs"] = _merge_logprobs(c.get("logprobs"), d.get("logprobs"), len(c["text"]))
        c["text"] = c["text"] + str(d.get("text", ""))
    c["finish_reason"] = d.get("finish_reason")
    c["stop_reason"] = d.get("stop_reason")
    if body.get("return_token_ids"):
        c["token_ids"] = [first.token, *(d.get("token_ids") or [])]
    else:
        out.pop("prompt_token_ids", None)
        _keep_ids(c, False)
    usage = _fix_usage(rest.get("usage"))
    if isinstance(usage, dict):
        out["usage"] = usage
    return out


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_error(message: str, status: int) -> bytes:
    """The event that ends a stream whose decode leg broke after token 1 was
    sent: an OpenAI-style error, and no [DONE]."""
    body = {"error": {"message": message, "type": "bad_gateway", "code": status}}
    return sse(body)


DONE = b"data: [DONE]\n\n"
