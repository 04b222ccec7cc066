"""Every failure becomes an OpenAI-style body: {"error": {"message", "type", "param", "code"}}.

A client error is a `RequestError` (protocol.py) raised anywhere in a handler; the handlers registered here
render it and count it in `sparkspec_http_errors_total{status}`. Engine exceptions map to statuses in one place
(`from_engine`). Unknown routes (404) and wrong methods (405) get the same body; a client that leaves while its
body is read is an abort, not an error; anything else is a bug, logged with its traceback, and still a JSON 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from sparkspec.engine.async_engine import EngineDeadError, RequestFailedError
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.serve.connections import TIMED_OUT
from sparkspec.serve.protocol import RequestError, short

RETRY_AFTER_S = 1  # what a 429 / 503 asks the client to wait
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
log = logging.getLogger("sparkspec.serve")


def queue_full(e: QueueFullError) -> RequestError:
    return RequestError(str(e), status=429, type_="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def from_engine(e: Exception, param: str | None = None) -> RequestError:
    """The status of an exception the engine raised for one request: queue full 429, a request it refuses 400
    (`param` names the field), the engine stopped 503, this request failed in a step 500."""
    if isinstance(e, QueueFullError):
        return queue_full(e)
    if isinstance(e, EngineDeadError):
        return RequestError(str(e), status=503, type_="server_error")
    if isinstance(e, RequestFailedError):
        return RequestError(str(e), status=500, type_="server_error")
    if isinstance(e, ValueError):
        return RequestError(str(e), param)
    raise TypeError(f"not an engine error: {e!r}") from e


def error_response(request: Request, e: RequestError) -> JSONResponse:
    request.app.state.metrics.http_errors.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def on_request_error(request: Request, e: RequestError) -> JSONResponse:
    return error_response(request, e)


async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Unknown route (404), wrong method (405)."""
    path = short(request.url.path, quote=False)  # a 60 kB path is not echoed back
    what = {404: f"no route {path}",
            405: f"method {short(request.method, quote=False)} is not allowed on {path}"}.get(e.status_code,
                                                                                               str(e.detail))
    return error_response(request, RequestError(what, status=e.status_code, code=HTTP_CODES.get(e.status_code),
                                                headers=dict(e.headers or {})))


async def on_client_gone(request: Request, e: ClientDisconnect) -> Response:
    """The client went away while its body was read: counted as an abort, not a server error."""
    if not request.scope.get(TIMED_OUT):  # a read the protocol ended has been logged and counted (408) there
        log.info("%s:%s went away while sending its request body (%s %s)", *(request.client or ("?", "?")),
                 request.method, short(request.url.path, quote=False))
        request.app.state.metrics.observe_aborted()
    return Response(status_code=499)  # nobody reads it


async def on_server_error(request: Request, e: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered with an OpenAI-style 500."""
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, RequestError(f"internal server error ({type(e).__name__})", status=500,
                                                type_="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_server_error)
