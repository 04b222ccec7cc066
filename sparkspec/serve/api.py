"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE with `stream: true`), /v1/models,
/health, /metrics; and the playground: `/` (a static page from `static/`) with `/v1/sparkspec/info`.

A request's path: `prepare.py` reads, parses, validates and tokenises it (in a worker thread) and asks the
engine whether it can run it; `run.py` drives it on the engine and streams or returns the answer, shaped by
`responses.py`; any failure becomes an OpenAI-style error body (`errors.py`). The engine never sees a bad request.

The handlers are module-level and read everything from `app.state`:
  engine    the `AsyncLLMEngine` (its facade: info, tokenizer, encode_prompt, check, generate, abort, stats)
  metrics   the `ServerMetrics` (Prometheus registry)
  settings  the `ServerSettings` (model name, default max_tokens, body size limit, chat format)
  draining  True once `drain` (called by the server on SIGTERM) has begun: new requests get 503, running ones
            have a while to finish, then the rest end with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sparkspec.chat import resolve_chat_format
from sparkspec.engine.async_engine import AsyncLLMEngine, EngineInfo
from sparkspec.serve.errors import install_error_handlers
from sparkspec.serve.metrics import ServerMetrics
from sparkspec.serve.prepare import (
    DEFAULT_MAX_REQUEST_BYTES,
    ServerSettings,
    admit,
    check_accepting,
    prepare_chat,
    prepare_completion,
    read_body,
)
from sparkspec.serve.responses import ChatView, CompletionView
from sparkspec.serve.run import run

STATIC_DIR = Path(__file__).parent / "static"  # the playground: plain files, no build step (package-data)
log = logging.getLogger("sparkspec.serve")
router = APIRouter()


def create_app(engine: AsyncLLMEngine, model_name: str, default_max_tokens: int = 256,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, chat_format: str = "auto") -> FastAPI:
    """The app over `engine`; the engine thread starts with the app and stops with it. Besides the state above,
    `app.state.drain(timeout)` and `app.state.count_refused(status)` are for the server (serve/cli.py) and its
    HTTP protocol (connections.py). `chat_format` (auto | deepseek-v4 | jinja) that the tokenizer cannot serve is
    a ValueError naming `chat_format`."""
    app = FastAPI(title="sparkspec", lifespan=lifespan)
    metrics = ServerMetrics(engine)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.settings = ServerSettings(model_name, default_max_tokens, max_request_bytes,
                                        chat_format_of(engine.tokenizer, chat_format))
    app.state.draining = False
    app.state.drain = functools.partial(drain, app)
    app.state.count_refused = lambda status: metrics.http_errors.labels(str(status)).inc()
    install_error_handlers(app)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def chat_format_of(tokenizer, requested: str):
    if tokenizer is None:
        if requested != "auto":
            raise ValueError(f"chat_format: {requested} needs a tokenizer; this model has none")
        return None
    return resolve_chat_format(tokenizer, requested)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    app.state.engine.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, app.state.engine.shutdown)


async def drain(app: FastAPI, timeout: float) -> None:
    """Refuse new requests (503), give running ones `timeout` seconds, then end the rest with an error."""
    engine: AsyncLLMEngine = app.state.engine
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


def server_info(info: EngineInfo, settings: ServerSettings) -> dict:
    """What a client (the playground) may set per request. The method is fixed when the server starts (one
    drafter is loaded and its caches sized), so it is reported with the reason; k can be lowered per request
    through the `speculative` extension whenever the server drafts at all."""
    k = info.num_spec_tokens
    return {"model": settings.model_name, "max_model_len": info.max_model_len,
            "default_max_tokens": settings.default_max_tokens, "chat_format": settings.chat_format,
            "speculative": {"method": info.spec_method, "num_spec_tokens": k, "budget": info.spec_budget,
                            "per_request_method": False,
                            "per_request_method_reason": "the server runs one method, chosen at start (--spec)",
                            "per_request_num_spec_tokens": k > 0},
            "extensions": ["speculative", "sparkspec.token_sources"]}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    engine, settings = request.app.state.engine, request.app.state.settings
    raw = await read_body(request)
    req, prompt_ids, params, text = await asyncio.to_thread(prepare_completion, engine, settings, raw)
    check_accepting(request)
    admit(engine, prompt_ids, params)
    view = CompletionView(f"cmpl-{uuid.uuid4().hex[:24]}", settings.model_name, engine.tokenizer, prompt_ids, text,
                          req.echo, req.logprobs, req.wants_token_sources())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, prompt_ids, params, view, req.stream, include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    engine, settings = request.app.state.engine, request.app.state.settings
    raw = await read_body(request)
    req, prompt_ids, params, output = await asyncio.to_thread(prepare_chat, engine, settings, raw)
    check_accepting(request)
    admit(engine, prompt_ids, params)
    view = ChatView(f"chatcmpl-{uuid.uuid4().hex[:24]}", settings.model_name, engine.tokenizer, prompt_ids,
                    params.logprobs, req.wants_token_sources(), output)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, prompt_ids, params, view, req.stream, include_usage)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    name, info = request.app.state.settings.model_name, request.app.state.engine.info
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sparkspec",
                                        "max_model_len": info.max_model_len}]}


@router.get("/v1/sparkspec/info")
async def info(request: Request) -> dict:
    return server_info(request.app.state.engine.info, request.app.state.settings)


@router.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html")


@router.get("/health")
async def health(request: Request) -> Response:
    draining = request.app.state.draining
    if request.app.state.engine.is_running and not draining:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "shutting down" if draining else "unavailable"}, status_code=503)


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
