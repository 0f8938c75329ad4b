"""The FastAPI application: OpenAI routes over one `EngineLoop`.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (API key
checked when one is set), ``GET /health`` and ``GET /metrics`` (open). Every error is answered
in the OpenAI shape (`kvplan.server.protocol.ApiError`). Streaming answers are server-sent
events, one per step that produced text, ending with ``data: [DONE]``. A client that goes
away (streaming or not) has its engine requests aborted, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvplan.engine.llm import LLM, RequestOutput
from kvplan.server.engine_loop import EngineLoop, Event, Handle, QueueFull
from kvplan.server.logprobs_format import chat_logprobs, completion_logprobs
from kvplan.server.metrics import Metrics
from kvplan.server.protocol import (
    TOOL_CALL_OPEN,
    ApiError,
    ModelLimits,
    Parsed,
    hermes_tool_calls,
    parse_chat,
    parse_completion,
)


class _SSEResponse(StreamingResponse):
    """A streaming response that calls ``on_close`` however it ends (done, error, or the
    client went away and the stream was cancelled)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _gauges(llm: LLM, loop: EngineLoop) -> dict[str, tuple[str, Callable[[], dict]]]:
    sched = llm.engine.scheduler
    manager, num_blocks = llm.parts.manager, llm.parts.num_blocks
    pools = range(len(getattr(manager, "pools", [None])))
    sizes = getattr(llm.parts, "pool_sizes", None)  # per pool (sliding-window pools are smaller)
    usable = {p: (num_blocks if sizes is None else sizes.num_blocks[p]) - 1 for p in pools}

    def used() -> dict[str, float]:
        if not hasattr(manager, "num_free_blocks"):
            return {}
        return {f'{{pool="{p}"}}': usable[p] - manager.num_free_blocks(p) for p in pools}

    return {
        "kvplan_requests_running": ("requests in the running batch", lambda: {"": len(sched.running)}),
        "kvplan_requests_waiting": (
            "requests waiting for the running batch (queued in the engine or not yet added)",
            lambda: {"": max(0, loop.num_live - len(sched.running))},
        ),
        "kvplan_requests_waiting_for_shared_prefix": (
            "waiting requests the last step put off until blocks of their prompt that a running request is computing are written (wait_for_shared_prefix)",
            lambda: {"": sched.num_waiting_for_prefix},
        ),
        "kvplan_kv_blocks_used": ("KV cache blocks held by requests, per pool", used),
        "kvplan_kv_blocks_total": ("usable KV cache blocks per pool", lambda: {f'{{pool="{p}"}}': usable[p] for p in pools}),
    }  # fmt: skip


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def build_app(
    llm: LLM,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_live_requests: int | None = None,
) -> FastAPI:
    """The server's app over ``llm`` (which nothing else may step while the app runs).

    ``max_live_requests`` (default: four times ``max_num_seqs``) bounds the engine requests
    running or waiting; beyond it requests get 503.
    """
    name = model_name or llm.parts.source.name
    tok = llm.tokenizer
    limits = ModelLimits(name, llm.engine.max_model_len, llm.engine.check_prompt)
    live = max_live_requests or 4 * llm.config.max_num_seqs
    metrics = Metrics({})
    engine = EngineLoop(llm, metrics, max_live_requests=live)
    metrics.gauges = _gauges(llm, engine)
    created = int(time.time())

    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="kvplan", lifespan=lifespan)
    app.state.engine, app.state.llm, app.state.metrics = engine, llm, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            what = "no API key was given" if not given else "the API key is not valid"
            raise ApiError(401, what, code="invalid_api_key")

    async def read_body(request: Request) -> Any:
        check_key(request)
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = engine.alive
        return JSONResponse(
            {"status": "ok" if alive else "down"}, status_code=200 if alive else 503
        )

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        card = {"id": name, "object": "model", "created": created, "owned_by": "kvplan"}
        return {"object": "list", "data": [{**card, "max_model_len": limits.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(await read_body(request), tok, limits)
        return await respond(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        parsed = parse_chat(await read_body(request), tok, limits)
        return await respond(request, parsed, chat=True)

    async def respond(request: Request, parsed: Parsed, *, chat: bool):
        if any(p.json_mode for p in parsed.params):
            try:  # the first call builds the vocabulary trie (seconds): off the event loop
                await asyncio.get_running_loop().run_in_executor(None, engine.check_json_mode)
            except ValueError as exc:
                param = "tools" if parsed.tool_call else "response_format"
                raise ApiError(400, str(exc), param=param) from None
        try:
            handle = engine.submit(parsed.prompts, parsed.params, asyncio.get_running_loop())
        except QueueFull as exc:
            raise ApiError(503, str(exc), type="server_error", code="server_overloaded") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param="n") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            body = _stream(handle, parsed, chat, rid)
            return _SSEResponse(body, on_close=lambda: engine.abort(handle))
        events = await _collect(handle, request)
        if events is None:  # the client went away
            return JSONResponse({}, status_code=499)
        for ev in events:
            if ev.error or ev.output is None or ev.output.finish_reason == "error":
                raise ApiError(500, ev.error or "the engine failed this request", type="server_error")  # fmt: skip
        choices = []
        for k, ev in enumerate(best_events(parsed, events)):
            out = ev.output
            if chat:
                finish = out.finish_reason
                content, calls = _answer_calls(parsed, out.text, finish)
                msg = {"role": "assistant", "content": content}
                if calls:
                    msg["tool_calls"] = _call_entries(calls, f"call_{rid[9:]}_{k}")
                    finish = "tool_calls" if finish == "stop" else finish
                lps = None if parsed.logprobs is None else chat_logprobs(tok, out.logprobs)
                choices.append({"index": k, "message": msg, "logprobs": lps, "finish_reason": finish})  # fmt: skip
            else:
                text, lps = _completion_choice(tok, parsed, out)
                choices.append({"index": k, "text": text, "logprobs": lps, "finish_reason": out.finish_reason})  # fmt: skip
        usage = _usage(
            parsed,
            [_num_generated(parsed, ev.output.token_ids) for ev in events],
            [ev.output.num_cached_prefix_tokens for ev in events],
        )
        obj = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": choices, "usage": usage}  # fmt: skip

    async def _collect(handle: Handle, request: Request) -> list[Event] | None:
        """Every choice's final event, or None when the client disconnected first."""
        events: list[Event | None] = [None] * handle.num_choices
        remaining = handle.num_choices
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while remaining:
                get = asyncio.ensure_future(handle.queue.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                ev = get.result()
                if ev.finished:
                    events[ev.choice] = ev
                    remaining -= 1
            return events  # type: ignore[return-value]
        finally:
            gone.cancel()
            if remaining:
                engine.abort(handle)

    async def _stream(handle: Handle, parsed: Parsed, chat: bool, rid: str) -> AsyncIterator[str]:
        num = handle.num_choices
        ids: list[list[int]] = [[] for _ in range(num)]
        sent = [""] * num
        counts = [0] * num
        cached = [0] * num
        stamp = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if parsed.include_usage else {}

        offsets = [0] * num  # completions: text offset of the next token
        echoed = [not parsed.echo] * num

        def chunk(k: int, text: str | None, finish: str | None, first: bool = False, ids=(), lps=None, call=None) -> str:  # fmt: skip
            logprobs = None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                if call is not None:  # the tool_calls entries
                    delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(call)]
                if lps is not None:
                    logprobs = chat_logprobs(tok, lps)
                choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                if lps is not None:
                    logprobs, offsets[k] = completion_logprobs(tok, ids, lps, offsets[k])
                choice = {
                    "index": k,
                    "text": text or "",
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            return _sse({"id": rid, "object": obj, "created": stamp, "model": name, "choices": [choice], **extra})  # fmt: skip

        if chat:
            for k in range(num):
                yield chunk(k, None, None, first=True)
        done = 0
        while done < num:
            ev = await handle.queue.get()
            k = ev.choice
            out = ev.output
            if ev.error or (out is not None and out.finish_reason == "error"):
                err = ApiError(500, ev.error or "the engine failed this request", type="server_error")  # fmt: skip
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            if not echoed[k]:  # the prompt, once, before the first completion chunk
                echoed[k] = True
                prompt = parsed.prompts[k]
                plps = None
                if parsed.logprobs is not None:
                    plps = ev.prompt_logprobs or [None] * len(prompt)
                yield chunk(k, _decode(tok, prompt), None, ids=prompt, lps=plps)
            new, lps = ev.token_ids, ev.logprobs
            if parsed.score_only:
                new, lps = [], None
            ids[k] += new
            counts[k] += len(new)
            if out is not None:
                text, finish = ("" if parsed.score_only else out.text), out.finish_reason
                cached[k] = out.num_cached_prefix_tokens
                done += 1
            else:
                text, finish = _partial_text(tok, ids[k], parsed.params[k].stop_strings), None
            if parsed.tool_call or parsed.tool_names:  # calls go out whole at the end
                if out is None:  # a forced call's text never streams; a free answer's does
                    text = "" if parsed.tool_call else _before_tool_call(text)  # up to a block
                else:
                    content, calls = _answer_calls(parsed, text, finish)
                    if calls:
                        content = content or ""
                        delta = content[len(sent[k]) :] if content.startswith(sent[k]) else ""
                        yield chunk(k, delta, "tool_calls" if finish == "stop" else finish,
                                    lps=lps or None, call=_call_entries(calls, f"call_{rid[9:]}_{k}"))  # fmt: skip
                        continue
            delta = text[len(sent[k]) :] if text.startswith(sent[k]) else ""
            if lps is not None and not lps:
                lps = None
            if delta or finish is not None or lps is not None:
                sent[k] += delta
                yield chunk(k, delta, finish, ids=new, lps=lps)
        if parsed.include_usage:
            usage = _usage(parsed, counts, cached)
            yield _sse({"id": rid, "object": obj, "created": stamp, "model": name, "choices": [], "usage": usage})  # fmt: skip
        yield "data: [DONE]\n\n"

    return app


def _answer_calls(parsed: Parsed, text: str, finish: str | None) -> tuple[str | None, list]:
    """(content, calls) of a finished chat answer, each call ``{"name", "arguments"}`` with
    the arguments' JSON text: a forced call whose text ended complete (no content), the
    ``<tool_call>`` blocks of a free answer under tool_choice auto (the text around them, or
    None), else ``(text, [])``."""
    if parsed.tool_call:
        if finish != "stop":
            return text, []
        try:
            call = json.loads(text)
        except ValueError:
            return text, []
        return None, [{"name": call["name"],
                       "arguments": json.dumps(call["arguments"], ensure_ascii=False)}]  # fmt: skip
    if parsed.tool_names:
        content, calls = hermes_tool_calls(text, parsed.tool_names)
        if calls:
            return content or None, calls
    return text, []


def _call_entries(calls: list[dict], id_prefix: str) -> list[dict]:
    """``tool_calls`` entries of `_answer_calls`'s calls."""
    return [{"id": f"{id_prefix}_{i}", "type": "function", "function": c} for i, c in enumerate(calls)]  # fmt: skip


def _before_tool_call(text: str) -> str:
    """The part of a streamed answer that may go out before its end: up to its first
    ``<tool_call>``, holding back a tail that may be the start of one."""
    cut = text.find(TOOL_CALL_OPEN)
    if cut >= 0:
        return text[:cut]
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return text[:-n]
    return text


def _decode(tok: Any, ids: list[int]) -> str:
    return "" if tok is None else tok.decode(ids, skip_special_tokens=True)


def _num_generated(parsed: Parsed, token_ids: list[int]) -> int:
    return 0 if parsed.score_only else len(token_ids)


def _completion_choice(tok: Any, parsed: Parsed, out: RequestOutput) -> tuple[str, dict | None]:
    """A completion's text (the prompt's first with echo) and its logprobs object."""
    ids = [] if parsed.score_only else list(out.token_ids)
    entries: list = [] if parsed.score_only else list(out.logprobs or ())
    text = "" if parsed.score_only else out.text
    if parsed.echo:
        text = _decode(tok, out.prompt_token_ids) + text
        ids = out.prompt_token_ids + ids
        entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
    if parsed.logprobs is None:
        return text, None
    return text, completion_logprobs(tok, ids, entries)[0]


def _partial_text(tok: Any, ids: list[int], stops: tuple[str, ...]) -> str:
    """The text of an unfinished request that is safe to send: an incomplete multi-byte
    character is held back, and with stop strings the last ``max(len(stop)) - 1``
    characters (they may start a stop string, which is cut from the final text)."""
    if tok is None:
        return ""
    text = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: max(0, len(text) - hold)]


def best_events(parsed: Parsed, events: list[Event]) -> list[Event]:
    """The returned choices: every event, or with ``best_of`` each prompt's ``n`` sequences
    with the highest mean log-probability per generated token (of the model's raw
    distribution, as the logprobs report it), best first; ties keep generation order."""
    if parsed.best_of is None:
        return events
    keep = []
    for i in range(parsed.num_prompts):
        group = events[i * parsed.best_of : (i + 1) * parsed.best_of]
        keep += sorted(group, key=lambda ev: -mean_logprob(ev.output))[: parsed.n]
    return keep


def mean_logprob(out: RequestOutput) -> float:
    """Mean log-probability of a completion's generated tokens (``-inf`` for none)."""
    lps = [e.logprob for e in out.logprobs or () if e is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


def _usage(parsed: Parsed, completion_tokens: list[int], cached_tokens: list[int]) -> dict:
    """Prompt tokens once per prompt; completion tokens of every generated sequence (with
    ``best_of``, those not returned too); ``prompt_tokens_details.cached_tokens``: the prompt
    tokens the prefix cache served, once per prompt (its first sequence's; the others of a
    prompt, engine requests of their own, usually resume from it)."""
    k = parsed.per_prompt
    prompt = sum(len(parsed.prompts[i * k]) for i in range(parsed.num_prompts))
    comp = sum(completion_tokens)
    cached = sum(cached_tokens[i * k] for i in range(parsed.num_prompts))
    return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


async def _disconnected(request: Request) -> None:
    """Returns once the client closed its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
