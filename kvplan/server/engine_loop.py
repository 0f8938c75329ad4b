"""`EngineLoop`: one background thread drives the engine for every HTTP connection.

Continuous batching: a request submitted from the asyncio side is queued as a command and
joins the running batch at the next step (`LLM.add_request` between two `LLM.step` calls).
After each step the thread hands every touched request's new token ids to the asyncio queue of
its `Handle` (``loop.call_soon_threadsafe``); finished requests (``LLM.pop_finished``) hand
over their `RequestOutput`. Every engine call (add, abort, step, pop) runs on this one thread,
so no other thread steps the engine and a step's results always reach their handles.

A request whose client went away is aborted through `EngineLoop.abort` (its blocks freed at
once). A step that raises finishes its running requests with ``finish_reason="error"`` (the
engine's contract), which their handles receive; the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from kvplan.engine.llm import LLM, RequestOutput
from kvplan.engine.logprobs import TokenLogprob
from kvplan.engine.sampling import SamplingParams
from kvplan.server.metrics import Metrics


class QueueFull(Exception):
    """The engine holds as many live requests as the server admits."""


@dataclass
class Event:
    """What one engine request produced: ``choice`` (its index in the `Handle`), new token
    ids, and when it finished its `RequestOutput` (or ``error``: it could not be added)."""

    choice: int
    token_ids: list[int]
    output: RequestOutput | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first event, when asked

    @property
    def finished(self) -> bool:
        return self.output is not None or self.error is not None


@dataclass
class Handle:
    """The asyncio side of one HTTP request's engine requests (one per choice)."""

    loop: asyncio.AbstractEventLoop
    num_choices: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_ids: list[int] = field(default_factory=list)  # set by the engine thread

    def put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclass
class _Live:
    """Engine-thread record of one live request."""

    handle: Handle
    choice: int
    arrival: float
    num_sent: int = 0
    last_token: float | None = None
    prompt_sent: bool = False  # prompt logprobs handed over (requests that ask for them)


class EngineLoop:
    """Drives ``llm`` on a background thread (module docstring).

    Args:
        llm: the engine; nothing else may step it while the loop runs.
        metrics: updated with token counts and latencies.
        max_live_requests: most engine requests (running + waiting) at once; a submission
            beyond it raises `QueueFull` (HTTP 503).
    """

    def __init__(self, llm: LLM, metrics: Metrics, *, max_live_requests: int) -> None:
        self.llm = llm
        self.metrics = metrics
        self.max_live_requests = max_live_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # engine thread only
        self._num_live = 0  # submitted, not yet finished (any thread, under _count_lock)
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ any thread
    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvplan-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (live requests are aborted)."""
        if self._thread is not None:
            self._stopping = True
            self._commands.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        loop: asyncio.AbstractEventLoop,
    ) -> Handle:
        """Queue one engine request per ``(prompts[i], params[i])`` (validated already);
        raises `QueueFull` when they do not all fit now, ValueError when they never can."""
        n = len(prompts)
        if n > self.max_live_requests:
            raise ValueError(
                f"{n} completions in one request; this server runs at most "
                f"{self.max_live_requests} at once"
            )
        with self._count_lock:
            if self._num_live + n > self.max_live_requests:
                self.metrics.count_rejected()
                raise QueueFull(
                    f"the server holds {self._num_live} requests (at most "
                    f"{self.max_live_requests}); retry later"
                )
            self._num_live += n
        handle = Handle(loop, n)
        self._commands.put(("add", handle, prompts, params))
        return handle

    def check_json_mode(self) -> None:
        """ValueError when the engine cannot run JSON mode (no tokenizer, or no token that
        starts an object), before anything is queued. Builds the engine's vocabulary trie
        once (the engine thread would build the same)."""
        self.llm.engine.json_vocab()

    def abort(self, handle: Handle) -> None:
        """Abort every unfinished request of ``handle`` (its client went away)."""
        self._commands.put(("abort", handle))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        llm = self.llm
        while True:
            idle = not llm.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = False
            while cmd is not False:
                if cmd is None or self._stopping:
                    self._shutdown()
                    return
                try:
                    self._do(cmd)
                except Exception as exc:  # never expected; the loop must keep serving
                    self._log("command failed", exc)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = False
            if llm.engine.has_unfinished():
                self._step()

    def _do(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, handle, prompts, params = cmd
            for choice, (ids, sp) in enumerate(zip(prompts, params)):
                try:
                    rid = self.llm.add_request(ids, sp)
                except Exception as exc:  # validated before; never expected
                    self._release(1)
                    handle.put(Event(choice, [], error=str(exc)))
                    continue
                handle.request_ids.append(rid)
                self._live[rid] = _Live(handle, choice, time.monotonic())
                self.metrics.request_added(len(ids))
        else:
            _, handle = cmd
            for rid in handle.request_ids:
                if rid in self._live:
                    self.llm.abort(rid)
            self._collect_finished()

    def _step(self) -> None:
        try:
            touched = self.llm.step()
        except Exception as exc:  # the engine finished the running requests with "error"
            self.metrics.count_step_error()
            self._log("engine step failed", exc)
            touched = []
        now = time.monotonic()
        for req in touched:
            live = self._live.get(req.request_id)
            if live is not None and not req.finished:
                lps = req.logprobs if req.params.logprobs is not None else None
                prompt = None
                if req.params.prompt_logprobs is not None and not req.needs_prompt_logprobs:
                    prompt = [None, *req.prompt_logprobs]
                self._send(live, req.output_token_ids, now, None, lps, prompt)
        self._collect_finished(now)

    def _collect_finished(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for out in self.llm.pop_finished():
            live = self._live.pop(out.request_id, None)
            self._release(1)
            self.metrics.request_finished(out.finish_reason, out.num_cached_prefix_tokens)
            if live is not None:
                self._send(live, out.token_ids, now, out, out.logprobs, out.prompt_logprobs)

    def _send(
        self,
        live: _Live,
        token_ids: list[int],
        now: float,
        out: RequestOutput | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        start = live.num_sent
        new = list(token_ids[start:])
        lps = None if logprobs is None else list(logprobs[start : start + len(new)])
        if prompt_logprobs is None or live.prompt_sent:
            prompt_logprobs = None
        else:
            live.prompt_sent = True
        if new:
            if live.last_token is None:
                self.metrics.first_token(now - live.arrival)
                self.metrics.tokens(len(new), None)
            else:
                self.metrics.tokens(len(new), (now - live.last_token) / len(new))
            live.last_token = now
            live.num_sent += len(new)
        if new or out is not None:
            live.handle.put(Event(live.choice, new, out, None, lps, prompt_logprobs))

    @staticmethod
    def _log(what: str, exc: BaseException) -> None:
        print(f"kvplan serve: {what}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _release(self, n: int) -> None:
        with self._count_lock:
            self._num_live -= n

    def _shutdown(self) -> None:
        for rid in list(self._live):
            self.llm.abort(rid)
        self._collect_finished()
