"""`sparkspec serve --model DIR [--host] [--port] [--spec ...]`: the OpenAI-compatible server (uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from sparkspec.engine.config import (
    BATCH_INVARIANT_HELP,
    DEFAULT_SAMPLING_SCHEME,
    NO_ASYNC_SCHEDULING_HELP,
    SAMPLING_SCHEME_HELP,
    SAMPLING_SCHEMES,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags of `serve` (`engine_kwargs` turns them into `build_llm`'s keywords)."""
    from sparkspec.spec_decode.methods import SPEC_METHODS

    p.add_argument("--spec", choices=SPEC_METHODS, default=None,
                   help="speculative method (default: dspark when the checkpoint has DSpark weights, else none)")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="drafts per request per step (k)")
    p.add_argument("--spec-budget", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: DSpark Algorithm 1 verification budget; fixed: verify every draft")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512M or 4G")
    p.add_argument("--kv-cache-fraction", type=float, default=None, help="fraction of free memory for the KV cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", choices=["auto", "keep", "dequantize"], default="auto",
                   help="FP8 / FP4 checkpoint weights: keep them quantised (FP8 GEMMs, FP4 experts), dequantize "
                        "them to --dtype, or auto (keep on GPUs, dequantize on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA / HIP graphs (by default decode and verify steps replay captured graphs on a GPU)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt from its first token (prefix caching is on by default)")
    p.add_argument("--sampling-scheme", choices=SAMPLING_SCHEMES, default=DEFAULT_SAMPLING_SCHEME,
                   help=SAMPLING_SCHEME_HELP)
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help=NO_ASYNC_SCHEDULING_HELP)


def engine_kwargs(args) -> dict:
    """`build_llm`'s keywords from the engine flags (`add_engine_args`)."""
    from sparkspec.engine.kv_plan import parse_memory

    return dict(
        speculative=args.spec or "auto", num_spec_tokens=args.num_spec_tokens, spec_budget=args.spec_budget,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
        memory_fraction=args.kv_cache_fraction, enforce_eager=args.enforce_eager, device=args.device,
        dtype=args.dtype, quantization=getattr(args, "quantization", "auto"),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        sampling_scheme=getattr(args, "sampling_scheme", DEFAULT_SAMPLING_SCHEME),
        async_scheduling=getattr(args, "async_scheduling", None),
        batch_invariant=getattr(args, "batch_invariant", False))


def build_engine(args, **extra):
    """Load the checkpoint and build the engine from the parsed flags (`engine.llm.build_llm`) -> the `LLM`.
    With --tensor-parallel-size N, `llm.engine` drives the other ranks; a heartbeat keeps them in step while idle."""
    from sparkspec.engine.llm import build_llm

    model_dir = Path(args.model) if args.model else _default_model()
    if not model_dir.exists():
        raise ValueError(f"model directory not found: {model_dir}")
    tp = getattr(args, "tensor_parallel_size", 1)
    llm = build_llm(model_dir, tensor_parallel_size=tp, expert_parallel=getattr(args, "enable_expert_parallel", False),
                    **engine_kwargs(args), **extra)
    if tp > 1:
        llm.engine.start_heartbeat()
    return llm


def _default_model() -> Path:
    from sparkspec.paths import DEFAULT_MODEL

    return DEFAULT_MODEL


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="name clients pass as 'model' (default: directory name)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond which the server answers 429")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="larger request bodies are refused with 413 before they are parsed (default 8 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before their streams are cut")
    p.add_argument("--timeout-header", type=float, default=30.0,
                   help="seconds a client has to send a request's head; then 408 and the connection is closed")
    p.add_argument("--timeout-body", type=float, default=120.0,
                   help="seconds a client has to send a request's body after its head; then 408 and close")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections at most; one more is answered 503 and closed")
    p.add_argument("--chat-format", choices=["auto", "deepseek-v4", "jinja"], default="auto",
                   help="how /v1/chat/completions renders messages: deepseek-v4 (DeepSeek-V4's encoding: thinking, "
                        "tools), jinja (the checkpoint's chat template), or auto (deepseek-v4 for a tokenizer with "
                        "the V4 markers and no template, else the template)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (one per GPU: NCCL; gloo on CPU)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: whole routed experts per process instead of expert slices")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it once the model is loaded: until then a client's connect
    is refused, not queued). Errors are one line (ValueError)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: expected a port number in 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over a TIME_WAIT socket
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise ValueError(f"--host {host} --port {port}: the address {why}") from None
    return sock


def cmd_serve(args) -> int:
    from sparkspec.engine.async_engine import AsyncLLMEngine
    from sparkspec.engine.llm import freeze_startup_heap
    from sparkspec.platform import check_device
    from sparkspec.serve.api import create_app
    from sparkspec.serve.connections import ConnectionLimits, uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes}: expected a positive number of bytes")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: expected seconds >= 0")
    limits = ConnectionLimits(header_timeout=args.timeout_header, body_timeout=args.timeout_body,
                              max_connections=args.max_connections)
    sock = listen_socket(args.host, args.port)  # before the model loads: a bad or taken port fails in a second
    check_device(args.device)
    llm = build_engine(args, max_waiting=args.max_waiting)
    engine, ckpt = llm.engine, llm.checkpoint
    name = args.served_model_name or Path(ckpt.path).name
    async_engine = AsyncLLMEngine(engine)
    try:  # a --chat-format the tokenizer cannot serve: one line, exit 2
        app = create_app(async_engine, name, default_max_tokens=args.default_max_tokens,
                         max_request_bytes=args.max_request_bytes, chat_format=args.chat_format)
    except ValueError:
        llm.close()
        raise
    print(f"serving '{name}' from {ckpt.path} on http://{args.host}:{sock.getsockname()[1]} "
          f"(spec={engine.config.speculative}, budget={engine.config.spec_budget}, "
          f"chat format {app.state.settings.chat_format or 'none'}); {engine.kv_plan.describe()}", file=sys.stderr)
    if engine.runner.graphs is not None:
        g = engine.runner.graphs
        print(f"CUDA graphs: {len(g.graphs)} captured (batch sizes {g.sizes}, query lengths {list(g.query_lens)}, "
              f"prefills of {list(g.prefill_lens)} tokens, "
              f"up to {max((R * q for R, q in g.prefill_shapes()), default=0)} rows) in "
              f"{g.capture_seconds:.1f} s, {g.graph_bytes / 2**20:.0f} MiB", file=sys.stderr)
    config = uvicorn_config(app, limits, app.state.count_refused, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = _server_class()(config, app.state.drain, args.shutdown_timeout)
    async_engine.on_death = server.engine_died
    freeze_startup_heap()  # full collections while serving scan what serving allocates, not the model
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()  # tensor parallel: the other ranks stop with rank 0
    if server.failure is not None:
        print(f"sparkspec serve: the engine died ({server.failure!r}); exiting with code 1", file=sys.stderr)
        return 1
    print("sparkspec serve: shut down cleanly", file=sys.stderr)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """SIGINT / SIGTERM: drain first (new requests get 503 while running ones have `shutdown_timeout` seconds
        to finish; the rest end with an error event), then uvicorn's shutdown (close the sockets, run the
        lifespan shutdown, which stops the engine thread), then return normally (uvicorn's default re-raises the
        signal, which would make the exit code -15). A second SIGINT skips the wait.

        If the engine thread dies, the server stops and `cmd_serve` exits 1, so that a supervisor restarts it:
        a live process that can only answer 503 helps nobody."""

        def __init__(self, config, drain, shutdown_timeout: float):
            super().__init__(config)
            self.drain, self.shutdown_timeout = drain, shutdown_timeout
            self.failure: BaseException | None = None

        def engine_died(self, e: BaseException) -> None:  # on the engine thread
            self.failure = e
            self.should_exit = True
            # backstop: should the event loop be stuck, still exit non-zero
            timer = threading.Timer(self.shutdown_timeout + 30, os._exit, (1,))
            timer.daemon = True
            timer.start()

        async def shutdown(self, sockets=None) -> None:
            if self.failure is None:
                task = asyncio.ensure_future(self.drain(self.shutdown_timeout))
                while not task.done() and not self.force_exit:
                    await asyncio.sleep(0.05)
                if not task.done():
                    task.cancel()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkspec")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
