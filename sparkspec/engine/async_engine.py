"""AsyncLLMEngine: the engine on a background thread, requests as asyncio streams (for the server).

Only the engine thread touches the engine. Requests and aborts reach it through a command queue; outputs come
back to the event loop with `call_soon_threadsafe`. Validation (`check`) runs in the caller, so a bad request is
refused before it is queued and can never disturb other requests. A stream that is closed early (client
disconnect, cancellation) aborts its request, which frees its KV blocks on the next engine iteration.

No single request may take the engine down. A request whose own row fails inside a step that otherwise commits
(its distribution is not finite: `RequestOutput.error`) gets RequestFailedError with that reason, and nothing
else notices: such a failure is attributable to the request and never counts towards stopping the engine. If
`engine.step()` raises, only the requests of that step fail (RequestFailedError; they are aborted, so their
blocks are freed) and the loop carries on; MAX_CONSECUTIVE_STEP_FAILURES such steps in a row (a step that
returns resets the count) mean the engine is broken. If the loop itself dies (a bug outside step, or steps
that keep failing whatever they hold), `on_death` is called so that the server can exit non-zero and be
restarted, instead of living on and answering only 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.outputs import RequestOutput
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.sampling_params import SamplingParams

log = logging.getLogger("sparkspec.engine")

# Steps that fail in a row, each with its own batch aborted, before the engine is declared broken: one bad
# request fails one step, but a device that fails every step must not leave a server that answers only errors.
MAX_CONSECUTIVE_STEP_FAILURES = 8


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """This request failed: its own row in a step (the message names the cause), or the engine step that held
    it raised; the request was aborted or finished (HTTP 500), the others were not."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is, fixed when it starts: the server reports it and sizes requests by it."""

    max_model_len: int  # prompt + output tokens of one request at most
    spec_method: str  # the speculative method ("none": no speculation)
    num_spec_tokens: int  # drafts per request per step at most (0: no speculation)
    spec_budget: str | None  # "adaptive" | "fixed"; None without speculation


class AsyncLLMEngine:
    """The server's only view of the engine: `info`, `tokenizer`, `encode_prompt`, `check`, `generate`, `abort`,
    `stats`, and the lifecycle (`start`, `shutdown`, `is_running`, `num_open_requests`). The wrapped
    `LLMEngine` (`self.engine`) belongs to the engine thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        k = engine.spec.num_spec_tokens if engine.spec is not None else 0
        self.info = EngineInfo(max_model_len=engine.max_model_len,
                               spec_method=engine.spec.proposer.method if engine.spec is not None else "none",
                               num_spec_tokens=k, spec_budget=engine.config.spec_budget if k else None)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending
        self._grammar_lock = threading.Lock()  # guards building the grammar backend (compile_grammar)
        self._num_pending = 0  # queued commands not yet seen by the engine thread
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None  # called on the engine thread
        self.num_failed_steps = 0
        self._failures_in_a_row = 0

    # ---- lifecycle ----
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sparkspec-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason 'abort'."""
        self._stop.set()
        self._commands.put(("wake", None, None, None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def num_open_requests(self) -> int:
        """Requests whose output stream is still open (queued, running, or not yet read to the end)."""
        with self._lock:
            return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- requests ----
    @property
    def tokenizer(self):
        """The model's tokenizer (None for a checkpoint without one); encoding is thread-safe."""
        return self.engine.tokenizer

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids: text is tokenised with BOS; ids are checked against the vocabulary (ValueError)."""
        return self.engine.encode_prompt(prompt)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (ValueError naming the field if xgrammar refuses it) into the engine's
        cache, in the calling thread: the server calls it from a worker thread, since a compile can take a second
        and the backend's first build several (xgrammar releases the GIL meanwhile); `check` on the event loop
        and `add_request` on the engine thread then find it cached. Thread-safe."""
        if params.structured is None:
            return
        with self._grammar_lock:  # one backend, however many threads ask for the first one at once
            backend = self.engine.grammars()
        backend.compile(params.structured)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError for a request that can never run; QueueFullError when the queue is full."""
        self.engine.check_request(prompt_ids, params)
        with self._lock:
            waiting = self.engine.scheduler.num_waiting + self._num_pending
        if waiting >= self.engine.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (max_waiting={self.engine.config.max_waiting})")

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request (each carries everything so far; the last has finished=True)."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        self.check(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (asyncio.get_running_loop(), q)
            self._num_pending += 1
        self._commands.put(("add", request_id, prompt_ids, params))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request whatever its state; its KV blocks are freed on the engine's next iteration."""
        self._commands.put(("abort", request_id, None, None))

    def stats(self) -> dict:
        """A consistent-enough snapshot for /metrics (plain int reads)."""
        e = self.engine
        return {"num_waiting": e.scheduler.num_waiting + self._num_pending, "num_running": e.scheduler.num_running,
                "kv_usage": e.kv_usage, "stats": e.stats}

    # ---- engine thread ----
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is closed
                pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up of each event loop per step, not one per output (each
        `call_soon_threadsafe` writes to the loop's self-pipe). Each stream still gets its outputs in order."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            targets = [self._streams.get(out.request_id) for out in outputs]
        for out, target in zip(outputs, targets):
            item = out
            if out.finish_reason == "error":
                log.warning("request %s failed: %s", out.request_id, out.error)
                item = RequestFailedError(out.error or "the request failed")
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the loop is closed
                pass

    def _handle(self, cmd) -> None:
        kind, request_id, prompt_ids, params = cmd
        if kind == "add":
            with self._lock:
                self._num_pending -= 1
            try:
                self.engine.add_request(prompt_ids, params, request_id=request_id)
            except (ValueError, QueueFullError) as e:
                self._deliver(request_id, e)
            except Exception as e:  # add_request records nothing before it raises: only this request fails
                log.exception("adding request %s failed", request_id)
                self._deliver(request_id, RequestFailedError(f"the engine could not add the request ({e!r})"))
        elif kind == "abort":
            self.engine.abort_request(request_id)

    def _fail_step(self, held: dict, e: Exception) -> None:
        """Fail the requests a raising step held: every one it had taken from the waiting queue, and any it
        dropped; the ones still waiting were not in the step and stay queued."""
        waiting = {id(seq) for seq in getattr(self.engine.scheduler, "waiting", ())}
        victims = [rid for rid, seq in held.items() if id(seq) not in waiting or rid not in self.engine.requests]
        self.num_failed_steps += 1
        log.error("engine step failed; failing its %d request(s) %s", len(victims), victims, exc_info=e)
        for rid in victims:
            self.engine.abort_request(rid)
            self._deliver(rid, RequestFailedError(f"the engine failed while generating ({type(e).__name__}); "
                                                  "see the server log"))
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(f"{self._failures_in_a_row} engine steps failed in a row") from e

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                try:
                    cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(cmd)
                    while True:
                        self._handle(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                held = dict(self.engine.requests)  # a failing step may already have dropped finished ones
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    self._fail_step(held, e)
                    continue
                self._failures_in_a_row = 0  # the step committed (failures of single rows included)
                if outputs:
                    self._deliver_step(outputs)
        except BaseException as e:  # a bug: fail every open stream instead of hanging it, then tell the server
            log.exception("engine thread crashed")
            self.error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))
            if self.on_death is not None:
                self.on_death(e)
        finally:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError("the server is shutting down"))


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: one step's outputs into their streams' queues."""
    for q, item in puts:
        q.put_nowait(item)
