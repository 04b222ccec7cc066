"""Drive one admitted request: its n samples run as n engine requests, merged as they produce, and come back as
an SSE stream (`stream: true`) or one JSON body. The endpoint's `view` (responses.py) shapes the chunks and body.

A client that goes away (mid-stream, or while waiting for a body) aborts every sample and is counted in
`sparkspec_requests_total{finish_reason="abort"}`. A stream that fails after its headers were sent ends with an
error event and `[DONE]`; before that, a failure is an ordinary error response (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparkspec.engine.async_engine import EngineDeadError, RequestFailedError
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.sampling_params import SamplingParams
from sparkspec.serve.errors import from_engine
from sparkspec.serve.metrics import ServerMetrics
from sparkspec.serve.responses import ChoiceState

log = logging.getLogger("sparkspec.serve")
DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks that its client is still there


async def merge(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several async streams as items arrive; the first error is raised, and closing the
    merged stream (or an error) closes every stream (for engine streams: aborts their requests)."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for item in stream:
                q.put_nowait((i, item))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def run(request: Request, prompt_ids: list[int], params: SamplingParams, view, stream: bool,
              include_usage: bool) -> Response:
    """Start the request's samples on the engine and answer: SSE when `stream`, else one JSON body."""
    engine = request.app.state.engine
    request_id = uuid.uuid4().hex[:24]
    samples = params.samples()
    outputs = merge([engine.generate(prompt_ids, p, f"{request_id}-{i}") for i, p in enumerate(samples)])
    metrics: ServerMetrics = request.app.state.metrics
    if stream:
        return StreamingResponse(sse(outputs, len(samples), view, include_usage, metrics),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await respond(request, outputs, len(samples), view, metrics)


async def sse(outputs, num_samples: int, view, include_usage: bool, metrics: ServerMetrics) -> AsyncIterator[str]:
    """The SSE events: one chunk per output with news, the usage chunk when asked, then [DONE]."""
    states, last, ended = [ChoiceState() for _ in range(num_samples)], {}, False
    try:
        async for i, out in outputs:
            last[i] = out
            chunk = view.chunk(i, out, states[i])
            if chunk is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
        for out in last.values():
            metrics.observe_finished(out)
        if include_usage:
            yield f"data: {json.dumps(view.usage_chunk(list(last.values())))}\n\n"
        ended = True
    except Exception as e:  # the request failed or was cut: say so, then end the stream as usual
        ended = True
        if not isinstance(e, (EngineDeadError, RequestFailedError, ValueError, QueueFullError)):
            log.exception("stream failed")
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
    finally:  # a disconnected client lands here (cancelled, or closed at a yield)
        if not ended:
            metrics.observe_aborted()
        await outputs.aclose()  # every sample is aborted
    yield "data: [DONE]\n\n"


async def respond(request: Request, outputs, num_samples: int, view, metrics: ServerMetrics) -> Response:
    """Wait for every sample's last output, or for the client to leave (499, the samples are aborted)."""

    async def consume():
        last = {}
        try:
            async for i, out in outputs:
                last[i] = out
        finally:
            await outputs.aclose()
        return [last[i] for i in range(num_samples)]

    async def watch_disconnect():
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(watch_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:  # the client went away: cancelling the consumer aborts the request
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        metrics.observe_aborted()
        return Response(status_code=499)
    try:
        outs = task.result()
    except (QueueFullError, ValueError, EngineDeadError, RequestFailedError) as e:  # e.g. lost the last queue slot
        raise from_engine(e) from None
    for out in outs:
        metrics.observe_finished(out)
    return JSONResponse(view.final(outs))
