"""Connection limits that uvicorn lacks: a deadline for the request head, a deadline for the body, and a bound on
open connections. They live in the HTTP protocol (a small subclass of uvicorn's h11 protocol), below the app, so
that they hold for every route and for clients that never complete a request the app could see.

- head: from the connection's first byte (or from the connection itself, for the first request) to the end of
  the request head. A client that sent part of a head gets a 408; one that sent nothing is closed quietly.
- body: from the end of the head to the end of the body. A stalled or trickling body (or a chunked one that
  declares 2^64 bytes) gets a 408 and the connection is closed; the app's pending read sees a disconnect.
- a connection beyond `max_connections` is answered 503 as soon as it sends its first bytes (answering before
  would race the client's request: a close with unread data resets the connection and loses the answer), and
  is closed then, or after at most REFUSED_GRACE_S: sockets are bounded, not only requests.

Deadlines are totals, not gaps between bytes, so a client that sends one byte a second cannot hold a connection
longer than the deadline. The defaults (30 s for a head of at most 16 KiB, 120 s for a body of at most 8 MiB)
pass a slow mobile client with room to spare."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("sparkspec.serve")
TIMED_OUT = "sparkspec.read_timed_out"  # scope key: the protocol ended the body read (the app logs nothing more)
REFUSED_GRACE_S = 1.0  # how long a connection over the bound may take to send the request it is refused


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 30.0  # seconds for the request head (request line + headers)
    body_timeout: float = 120.0  # seconds for the body, after the head
    max_connections: int = 512  # open connections; more are answered 503 and closed
    max_header_bytes: int = 16 << 10  # h11's bound on an incomplete event: the head, a chunk-size line

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} {value}: expected seconds > 0")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections}: expected a positive integer")


def error_bytes(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": {408: "request_timeout", 503: "too_many_connections"}.get(status)}}).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the module's limits (class attributes, set by `protocol_class`)."""

    limits: ConnectionLimits = ConnectionLimits()
    on_refused: Callable[[int], None] = staticmethod(lambda status: None)  # status of each answer given here

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = None  # asyncio.TimerHandle of the stage below
        self.stage: str | None = None  # "head" / "body": what the deadline waits for
        self.head_started = False  # a byte of the current head has arrived
        self.refused = False  # over max_connections: answered 503 at its first bytes

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refusing a connection: %d open (--max-connections %d)", len(self.connections) - 1,
                        self.limits.max_connections)
            self.refused = True
            self.deadline = self.loop.call_later(min(REFUSED_GRACE_S, self.limits.header_timeout),
                                                 self.transport.close)
            return
        self.arm("head", self.limits.header_timeout)

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            if not self.transport.is_closing():
                self.disarm()
                self.answer_and_close(503, f"the server has {self.limits.max_connections} open connections; "
                                           "retry later")
            return
        if self.conn.their_state is h11.IDLE:
            self.head_started = True
            if self.stage is None:  # the next request on a kept-alive connection: its head's clock starts now
                self.arm("head", self.limits.header_timeout)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self.follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.follow_state()

    def follow_state(self) -> None:
        """Move the deadline along with the request: head while their side is idle, body while it sends one."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self.stage != "body":
            self.arm("body", self.limits.body_timeout)
        elif state is h11.IDLE and self.stage == "body" or state not in (h11.IDLE, h11.SEND_BODY):
            self.disarm()
        if state is not h11.IDLE:
            self.head_started = False

    def arm(self, stage: str, seconds: float) -> None:
        self.disarm()
        self.stage, self.deadline = stage, self.loop.call_later(seconds, self.expire)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.stage, self.deadline = None, None

    def expire(self) -> None:
        stage, self.deadline, self.stage = self.stage, None, None
        if self.transport.is_closing():
            return
        seconds = self.limits.header_timeout if stage == "head" else self.limits.body_timeout
        log.info("%s:%s: request %s not received within %.0f s (--timeout-%s): closing the connection",
                 *(self.client or ("?", "?")), stage, seconds, "header" if stage == "head" else "body")
        message = f"the request {stage} did not arrive within {seconds:g} s"
        if stage == "head" and not self.head_started:  # an idle connection: nothing to answer
            self.transport.close()
        elif stage == "body" and self.cycle is not None and not self.cycle.response_started:
            self.scope[TIMED_OUT] = True
            self.cycle.response_started = self.cycle.response_complete = self.cycle.disconnected = True
            self.cycle.message_event.set()  # the app's pending receive() returns http.disconnect
            self.send_error(408, message)
        elif stage == "head":
            self.answer_and_close(408, message)
        else:  # the app already answered (e.g. 404) while the body kept trickling
            self.transport.close()

    def send_error(self, status: int, message: str) -> None:
        """An OpenAI-style JSON error through h11 (their request head was read), then close."""
        body = error_bytes(status, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        self.on_refused(status)

    def answer_and_close(self, status: int, message: str) -> None:
        """An error written as raw bytes (no request head to answer through h11), then close."""
        body = error_bytes(status, message)
        reason = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()
        self.on_refused(status)

    def send_400_response(self, msg: str) -> None:  # h11 could not parse the request, or its head is too long
        self.disarm()
        try:
            self.send_error(400, f"invalid HTTP request (malformed, or a head over {self.limits.max_header_bytes} "
                                 "bytes)")
        except h11.LocalProtocolError:  # a response is already under way on this connection
            self.transport.close()


def protocol_class(limits: ConnectionLimits, on_refused: Callable[[int], None] = lambda status: None) -> type:
    """uvicorn's `http=` argument: the guarded protocol with these limits; `on_refused(status)` counts the answers
    given by the protocol itself (408, 503, 400), which the app never sees."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "on_refused": staticmethod(on_refused)})


def uvicorn_config(app, limits: ConnectionLimits = ConnectionLimits(),
                   on_refused: Callable[[int], None] = lambda status: None, **kwargs) -> uvicorn.Config:
    """A uvicorn.Config serving `app` through the guarded protocol."""
    return uvicorn.Config(app, http=protocol_class(limits, on_refused),
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)
