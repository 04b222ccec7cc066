"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE with `stream: true`), /v1/models,
/health, /metrics; and the playground: `/` (a static page from `static/`) with `/v1/sparkspec/info`. Every client error is a 4xx with an OpenAI-style body; the engine never sees a bad request.

Reading the body, parsing, validation and tokenisation run in a worker thread, so a large prompt delays
nobody else's stream or /health. `drain` (called by the server on SIGTERM) answers new requests 503, lets
running ones finish for a while, then ends the rest with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sparkspec.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.serve.connections import TIMED_OUT
from sparkspec.serve.metrics import ServerMetrics
from sparkspec.serve.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, load_json,
                                      parse_request, short)
from sparkspec.serve.responses import ChatView, ChoiceState, CompletionView

RETRY_AFTER_S = 1
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
LONG_TEXT_CHARS = 1 << 16  # shorter texts encode in milliseconds: the GIL is not held long enough to matter
STATIC_DIR = Path(__file__).parent / "static"  # the playground: plain files, no build step (package-data)
log = logging.getLogger("sparkspec.serve")


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


def server_info(engine, model_name: str, default_max_tokens: int) -> dict:
    """What a client (the playground) may set per request. The method is fixed when the server starts (one
    drafter is loaded and its caches sized), so it is reported with the reason; k can be lowered per request
    through the `speculative` extension whenever the server drafts at all."""
    k = engine.spec.num_spec_tokens if engine.spec is not None else 0
    method = engine.spec.proposer.method if engine.spec is not None else "none"
    return {"model": model_name, "max_model_len": engine.max_model_len, "default_max_tokens": default_max_tokens,
            "speculative": {"method": method, "num_spec_tokens": k,
                            "budget": engine.config.spec_budget if k else None,
                            "per_request_method": False,
                            "per_request_method_reason": "the server runs one method, chosen at start (--spec)",
                            "per_request_num_spec_tokens": k > 0},
            "extensions": ["speculative", "sparkspec.token_sources"]}


def create_app(engine: AsyncLLMEngine, model_name: str, default_max_tokens: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    metrics = ServerMetrics(engine)
    tokenizer = engine.engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="sparkspec", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.draining = False
    app.state.count_refused = lambda status: metrics.http_errors.labels(str(status)).inc()  # by the HTTP protocol

    def error_response(e: RequestError) -> JSONResponse:
        metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):  # unknown route (404), wrong method (405)
        path = short(request.url.path, quote=False)  # a 60 kB path is not echoed back
        what = {404: f"no route {path}", 405: f"method {short(request.method, quote=False)} is not allowed on "
                f"{path}"}.get(e.status_code, str(e.detail))
        return error_response(RequestError(what, status=e.status_code, code=HTTP_CODES.get(e.status_code),
                                           headers=dict(e.headers or {})))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect):  # while its body was read: not a server error
        if not request.scope.get(TIMED_OUT):  # a read the protocol ended has been logged and counted (408) there
            client = request.client
            log.info("%s:%s went away while sending its request body (%s %s)", *(client or ("?", "?")),
                     request.method, short(request.url.path, quote=False))
            metrics.observe_aborted()
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):  # a bug: still an OpenAI-style body
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(RequestError(f"internal server error ({type(e).__name__})", status=500,
                                           type_="server_error"))

    def check_accepting() -> None:
        if app.state.draining:
            raise RequestError("the server is shutting down", status=503, type_="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})

    async def read_body(request: Request) -> bytes:
        """The raw body, refused early when it is not JSON (415) or larger than `max_request_bytes` (413)."""
        check_accepting()
        ctype = request.headers.get("content-type")
        media = ctype.split(";")[0].strip().lower() if ctype else "application/json"
        if media != "application/json" and not media.endswith("+json"):
            raise RequestError(f"Content-Type '{ctype}' is not supported; send application/json", status=415,
                               code="unsupported_media_type")
        too_large = RequestError(f"the request body exceeds {max_request_bytes} bytes (--max-request-bytes)",
                                 status=413, code="request_too_large", headers={"Connection": "close"})
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # a chunked body has no Content-Length: count as it arrives
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(req) -> None:
        if req.model != model_name:
            raise RequestError(f"model {short(req.model)} does not exist; this server serves '{model_name}'", "model",
                               code="model_not_found")

    def tokenize(text: str, add_bos: bool) -> list[int]:
        """`tokenizer.encode`, except that a long text goes through the HF tokenizer's `encode_batch`: only that
        call releases the GIL, and encoding 4 MB takes seconds, which would stall the event loop meanwhile."""
        hf = getattr(tokenizer, "tok", None)
        if len(text) < LONG_TEXT_CHARS or not hasattr(hf, "encode_batch"):
            return tokenizer.encode(text, add_special_tokens=add_bos)
        ids = hf.encode_batch([text], add_special_tokens=False)[0].ids
        bos = tokenizer.bos_token_id  # as Tokenizer.encode: BOS first unless the text starts with it
        return [bos] + ids if add_bos and bos is not None and (not ids or ids[0] != bos) else ids

    def encode(prompt: str | list[int], add_bos: bool, param: str) -> list[int]:
        try:
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise ValueError("this model has no tokenizer: send prompt token ids")
                return tokenize(prompt, add_bos)
            return engine.engine.encode_prompt(prompt)
        except ValueError as e:
            raise RequestError(str(e), param) from None

    def admit(prompt_ids: list[int], params) -> None:
        try:
            engine.check(prompt_ids, params)
        except QueueFullError as e:
            raise RequestError(str(e), status=429, type_="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            raise RequestError(str(e), "max_tokens" if "max_tokens" in str(e) else "prompt") from None
        if not engine.is_running:
            raise RequestError("the engine is not running", status=503, type_="server_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})

    def default_tokens(prompt_ids: list[int]) -> int:
        """max_tokens when the request gives none: the server default, capped by the room left in the context."""
        return max(1, min(default_max_tokens, engine.engine.max_model_len - len(prompt_ids)))

    async def run(request: Request, prompt_ids: list[int], params, view, stream: bool, include_usage: bool):
        """Drive one request's n samples (one engine request each, merged as they produce); `view` builds the
        endpoint's SSE chunks (`view.chunk`) and body (`view.final`)."""
        request_id = uuid.uuid4().hex[:24]
        samples = params.samples()
        outputs = merge([engine.generate(prompt_ids, p, f"{request_id}-{i}") for i, p in enumerate(samples)])

        if stream:
            async def sse():
                states, last, ended = [ChoiceState() for _ in samples], {}, False
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

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def consume():
            last = {}
            try:
                async for i, out in outputs:
                    last[i] = out
            finally:
                await outputs.aclose()
            return [last[i] for i in range(len(samples))]

        async def watch_disconnect():
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)

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
        except QueueFullError as e:  # lost a race for the last queue slot
            raise RequestError(str(e), status=429, type_="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            raise RequestError(str(e)) from None
        except EngineDeadError as e:
            raise RequestError(str(e), status=503, type_="server_error") from None
        except RequestFailedError as e:
            raise RequestError(str(e), status=500, type_="server_error") from None
        for out in outs:
            metrics.observe_finished(out)
        return JSONResponse(view.final(outs))

    def server_k() -> int:
        """Drafts per step the server verifies at most (0: no speculation)."""
        return engine.engine.spec.num_spec_tokens if engine.engine.spec is not None else 0

    def prepare_completion(raw: bytes):
        req = parse_request(CompletionRequest, load_json(raw))
        check_model(req)
        prompt = req.single_prompt()
        prompt_ids = encode(prompt, add_bos=True, param="prompt")
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids) if tokenizer is not None else ""
        return req, prompt_ids, req.sampling_params(default_tokens(prompt_ids), req.num_spec_tokens(server_k())), text

    def prepare_chat(raw: bytes):
        req = parse_request(ChatCompletionRequest, load_json(raw))
        check_model(req)
        if tokenizer is None or tokenizer.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        try:  # message content is text: special-token text in it stays text (only the template's markers are special)
            prompt_ids = tokenizer.encode_chat(req.chat_messages())
        except ValueError as e:
            raise RequestError(str(e), "messages") from None
        return req, prompt_ids, req.sampling_params(default_tokens(prompt_ids), req.num_spec_tokens(server_k()))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompt_ids, params, text = await asyncio.to_thread(prepare_completion, await read_body(request))
        check_accepting()
        admit(prompt_ids, params)
        view = CompletionView(f"cmpl-{uuid.uuid4().hex[:24]}", model_name, tokenizer, prompt_ids, text, req.echo,
                              req.logprobs, req.wants_token_sources())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, prompt_ids, params, view, req.stream, include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, prompt_ids, params = await asyncio.to_thread(prepare_chat, await read_body(request))
        check_accepting()
        admit(prompt_ids, params)
        view = ChatView(f"chatcmpl-{uuid.uuid4().hex[:24]}", model_name, tokenizer, prompt_ids, params.logprobs,
                        req.wants_token_sources())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run(request, prompt_ids, params, view, req.stream, include_usage)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "sparkspec", "max_model_len": engine.engine.max_model_len}]}

    @app.get("/v1/sparkspec/info")
    async def info():
        return server_info(engine.engine, model_name, default_max_tokens)

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/health")
    async def health():
        if engine.is_running and not app.state.draining:
            return {"status": "ok"}
        return JSONResponse({"status": "shutting down" if app.state.draining else "unavailable"}, status_code=503)

    async def drain(timeout: float) -> None:
        """Refuse new requests (503), give running ones `timeout` seconds, then end the rest with an error."""
        app.state.draining = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        running = engine.num_open_requests
        log.info("shutting down: waiting up to %.0f s for %d running request(s)", timeout, running)
        while engine.num_open_requests and loop.time() - start < timeout:
            await asyncio.sleep(0.05)
        cut = engine.num_open_requests
        if cut:  # stopping the engine ends every open stream with an error event and [DONE]
            await asyncio.to_thread(engine.shutdown)
        log.log(logging.WARNING if cut else logging.INFO, "shutdown after %.1f s: %d request(s) finished, %d cut",
                loop.time() - start, max(0, running - cut), cut)

    app.state.drain = drain

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
