"""AsyncLLMEngine: the engine on a background thread, requests as asyncio streams (for the server).

Only the engine thread touches the engine. Requests and aborts reach it through a command queue; outputs come
back to the event loop with `call_soon_threadsafe`. Validation (`check`) runs in the caller, so a bad request is
refused before it is queued and can never disturb other requests. A stream that is closed early (client
disconnect, cancellation) aborts its request, which frees its KV blocks on the next engine iteration.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from sparkspec.engine.llm_engine import LLMEngine, RequestOutput
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.sampling_params import SamplingParams

log = logging.getLogger("sparkspec.engine")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending
        self._num_pending = 0  # queued commands not yet seen by the engine thread
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None

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
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- requests ----
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

    def _handle(self, cmd) -> None:
        kind, request_id, prompt_ids, params = cmd
        if kind == "add":
            with self._lock:
                self._num_pending -= 1
            try:
                self.engine.add_request(prompt_ids, params, request_id=request_id)
            except (ValueError, QueueFullError) as e:
                self._deliver(request_id, e)
        elif kind == "abort":
            self.engine.abort_request(request_id)

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
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # a bug: fail every open stream instead of hanging it
            log.exception("engine thread crashed")
            self.error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))
        finally:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, EngineDeadError("the server is shutting down"))
