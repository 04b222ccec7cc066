"""From an HTTP body to what the engine runs: (request, prompt token ids, sampling params), or a RequestError.

`read_body` runs on the event loop (it only counts bytes); `prepare_completion` / `prepare_chat` parse, validate
and tokenise, and run in a worker thread, so that a large prompt delays nobody else's stream or /health;
`admit` asks the engine whether it can take the request, so that the engine never sees a bad one."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastapi import Request

from sparkspec.chat import ChatFormat
from sparkspec.engine.async_engine import AsyncLLMEngine
from sparkspec.engine.scheduler import QueueFullError
from sparkspec.sampling_params import SamplingParams
from sparkspec.serve.chat_format import ChatOutput, chat_prompt
from sparkspec.serve.errors import RETRY_AFTER_S, from_engine
from sparkspec.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    load_json,
    parse_request,
    short,
)

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
LONG_TEXT_CHARS = 1 << 16  # shorter texts encode in milliseconds: the GIL is not held long enough to matter


@dataclass(frozen=True)
class ServerSettings:
    """What `sparkspec serve` was started with that shapes every request (app.state.settings)."""

    model_name: str  # the only `model` a request may name
    default_max_tokens: int = 256  # max_tokens of a request that gives none (capped by the context left)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies are refused (413) before parsing
    chat_format: ChatFormat | None = None  # how /v1/chat/completions renders messages (None: it cannot)


def check_accepting(request: Request) -> None:
    """503 once the server is draining (SIGTERM): running requests finish, new ones go elsewhere."""
    if request.app.state.draining:
        raise RequestError("the server is shutting down", status=503, type_="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})


async def read_body(request: Request) -> bytes:
    """The raw body, refused early when it is not JSON (415) or larger than `max_request_bytes` (413)."""
    check_accepting(request)
    limit = request.app.state.settings.max_request_bytes
    ctype = request.headers.get("content-type")
    media = ctype.split(";")[0].strip().lower() if ctype else "application/json"
    if media != "application/json" and not media.endswith("+json"):
        raise RequestError(f"Content-Type '{ctype}' is not supported; send application/json", status=415,
                           code="unsupported_media_type")
    too_large = RequestError(f"the request body exceeds {limit} bytes (--max-request-bytes)", status=413,
                             code="request_too_large", headers={"Connection": "close"})
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body has no Content-Length: count as it arrives
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def tokenize(tokenizer, text: str, add_bos: bool) -> list[int]:
    """`tokenizer.encode`, except that a long text goes through the HF tokenizer's `encode_batch`: only that call
    releases the GIL, and encoding 4 MB takes seconds, which would stall the event loop meanwhile."""
    hf = getattr(tokenizer, "tok", None)
    if len(text) < LONG_TEXT_CHARS or not hasattr(hf, "encode_batch"):
        return tokenizer.encode(text, add_special_tokens=add_bos)
    ids = hf.encode_batch([text], add_special_tokens=False)[0].ids
    bos = tokenizer.bos_token_id  # as Tokenizer.encode: BOS first unless the text starts with it
    return [bos] + ids if add_bos and bos is not None and (not ids or ids[0] != bos) else ids


def check_model(req, settings: ServerSettings) -> None:
    if req.model != settings.model_name:
        raise RequestError(f"model {short(req.model)} does not exist; this server serves '{settings.model_name}'",
                           "model", code="model_not_found")


def sampling_params(req, engine: AsyncLLMEngine, settings: ServerSettings, prompt_ids: list[int]) -> SamplingParams:
    """The request's params; max_tokens defaults to the server's, capped by the room left in the context."""
    default = max(1, min(settings.default_max_tokens, engine.info.max_model_len - len(prompt_ids)))
    return req.sampling_params(default, req.num_spec_tokens(engine.info.num_spec_tokens))


def compile_grammar(engine: AsyncLLMEngine, params: SamplingParams) -> None:
    """Compile a structured request's grammar here, in the worker thread, so that `admit` on the event loop finds
    it cached: a large grammar takes a second to compile (the first one also builds the backend, seconds), which
    on the loop would stall every stream and /health."""
    try:
        engine.compile_grammar(params)
    except ValueError as e:
        raise from_engine(e, str(e).split(":")[0]) from None


def prepare_completion(engine: AsyncLLMEngine, settings: ServerSettings, raw: bytes):
    """-> (request, prompt ids, params, prompt text). The prompt is text (BOS added, special-token text parsed,
    as vLLM does) or token ids (checked against the vocabulary)."""
    req = parse_request(CompletionRequest, load_json(raw))
    check_model(req, settings)
    prompt, tokenizer = req.single_prompt(), engine.tokenizer
    try:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("this model has no tokenizer: send prompt token ids")
            prompt_ids = tokenize(tokenizer, prompt, add_bos=True)
        else:
            prompt_ids = engine.encode_prompt(prompt)
    except ValueError as e:
        raise RequestError(str(e), "prompt") from None
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids) if tokenizer is not None else ""
    params = sampling_params(req, engine, settings, prompt_ids)
    compile_grammar(engine, params)
    return req, prompt_ids, params, text


def prepare_chat(engine: AsyncLLMEngine, settings: ServerSettings, raw: bytes
                 ) -> tuple[ChatCompletionRequest, list[int], SamplingParams, ChatOutput | None]:
    """-> (request, prompt ids, params, how to read the output). Messages are rendered in the server's chat format
    (serve/chat_format.py); their content is text: special-token text in it stays text, so a message cannot forge
    a turn (only the format's own markers are special)."""
    req = parse_request(ChatCompletionRequest, load_json(raw))
    check_model(req, settings)
    prompt_ids, output = chat_prompt(req, settings.chat_format, engine.tokenizer)
    params = sampling_params(req, engine, settings, prompt_ids)
    if output is not None and output.structured is not None:  # a forced tool call: its grammar
        params = replace(params, structured=output.structured)
    compile_grammar(engine, params)
    return req, prompt_ids, params, output


def admit(engine: AsyncLLMEngine, prompt_ids: list[int], params: SamplingParams) -> None:
    """Refuse, before anything is queued, what the engine could never run (400), a full queue (429) and a stopped
    engine (503)."""
    try:
        engine.check(prompt_ids, params)
    except (QueueFullError, ValueError) as e:
        msg = str(e)
        field = msg.split(":")[0] if msg.startswith(("response_format", "structured_outputs", "tool_choice")) else \
            "max_tokens" if "max_tokens" in msg else "prompt"
        raise from_engine(e, field) from None
    if not engine.is_running:
        raise RequestError("the engine is not running", status=503, type_="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
