"""OpenAI request schemas, validated strictly: unknown fields, wrong types and out-of-range values are errors
(HTTP 400 with an OpenAI-style body), and OpenAI fields the engine does not implement are refused unless they
carry their neutral value (e.g. `best_of: 1`, `presence_penalty: 0`). Bookkeeping fields (`user`, `store`,
`metadata`, `service_tier`, `parallel_tool_calls`) are accepted and ignored.

Extension `speculative` (any request): `{"num_spec_tokens": K}` verifies at most K drafts per step for this
request (0..the server's k), `{"enabled": false}` turns drafting off for it; absent, the server's setting.
Speculation never changes the distribution sampled from, only how fast (greedy tokens are identical; seeded
sampled tokens are not draw for draw, since the draws follow the number of drafts verified).

Extension `sparkspec` (any request): `{"token_sources": true}` makes every choice (and every streamed chunk's
choice) carry `"sparkspec": {"token_sources", "token_texts", "spec"}`: how each output token came (see
`sparkspec.serve.provenance`). Without it, responses are plain OpenAI objects."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sparkspec.engine.grammar import parse_response_format, parse_structured_outputs
from sparkspec.sampling_params import MAX_N, SEED_END, SEED_MIN, SamplingParams, StructuredOutput

MAX_JSON_DEPTH = 32  # far above any request we accept; deeper bodies could exhaust the stack while compared
MAX_STOP, MAX_STOP_CHARS = 4, 1000  # OpenAI's count limit; long stop strings make every decode step slower


class RequestError(Exception):
    """A client error: rendered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**63)  # extension (vLLM): 0 / -1 disable
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM)
    speculative: Any = None  # extension (sparkspec): see the module docstring; checked by `num_spec_tokens`
    sparkspec: Any = None  # extension (sparkspec): {"token_sources": bool}; checked by `wants_token_sources`
    n: int = 1
    # bookkeeping fields of OpenAI's API: accepted and ignored
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields accepted only with their neutral value
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    response_format: Any = None  # text | json_object | json_schema (sparkspec.engine.grammar.parse_response_format)
    # vLLM's extension: {"json" | "regex" | "grammar" | "choice" | "structural_tag": ...} (parse_structured_outputs)
    structured_outputs: Any = None

    NEUTRAL: ClassVar[dict] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": (None, {})}

    def check_supported(self) -> None:
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            ok = value in neutral if isinstance(neutral, tuple) else value == neutral
            if not ok:
                raise RequestError(f"'{name}' = {short(value)} is not supported by this server (only {neutral!r})",
                                   name, code="unsupported_parameter")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"'n' must be an integer in [1, {MAX_N}]", "n")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > MAX_STOP or any(not s for s in stops):
                raise RequestError(f"'stop' must be up to {MAX_STOP} non-empty strings", "stop")
            if any(len(s) > MAX_STOP_CHARS for s in stops):
                raise RequestError(f"'stop' strings must be at most {MAX_STOP_CHARS} characters", "stop")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_END:
            raise RequestError("'seed' must be an integer in [-2**63, 2**64)", "seed")
        if self.stream_options is not None and not self.stream:
            raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options")
        self.wants_token_sources()

    def num_spec_tokens(self, server_k: int) -> int | None:
        """The request's draft cap from `speculative` (None: the server's), checked against the server's k (0 when
        it runs no speculation)."""
        spec, field = self.speculative, "speculative.num_spec_tokens"
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise RequestError("'speculative' must be an object such as {\"num_spec_tokens\": 2}", "speculative")
        unknown = sorted(set(spec) - {"num_spec_tokens", "enabled"})
        if unknown:
            raise RequestError(f"unsupported field 'speculative.{_printable(str(unknown[0]))}'", "speculative",
                               code="unsupported_parameter")
        enabled, k = spec.get("enabled", True), spec.get("num_spec_tokens")
        if not isinstance(enabled, bool):
            raise RequestError("'speculative.enabled' must be a boolean", "speculative.enabled")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= server_k):
            off = " (this server runs no speculation)" if not server_k else ""
            raise RequestError(f"'{field}' must be an integer in [0, {server_k}]{off}", field)
        if not enabled:
            if k:
                raise RequestError(f"'{field}' = {k} contradicts 'speculative.enabled': false", field)
            return 0
        if "enabled" in spec and k is None and not server_k:
            raise RequestError(f"speculation was asked for, but this server runs none ('{field}' must be 0)", field)
        return k

    def wants_token_sources(self) -> bool:
        """Whether the response carries per-token provenance (the `sparkspec` extension). Checked here rather than
        by a pydantic model so that a mistake reads as one line naming the field, like `speculative`'s."""
        ext = self.sparkspec
        if ext is None:
            return False
        if not isinstance(ext, dict):
            raise RequestError("'sparkspec' must be an object such as {\"token_sources\": true}", "sparkspec")
        unknown = sorted(set(ext) - {"token_sources"})
        if unknown:
            raise RequestError(f"unsupported field 'sparkspec.{_printable(str(unknown[0]))}'", "sparkspec",
                               code="unsupported_parameter")
        on = ext.get("token_sources", False)
        if not isinstance(on, bool):
            raise RequestError("'sparkspec.token_sources' must be a boolean", "sparkspec.token_sources")
        return on

    def structured_output(self) -> StructuredOutput | None:
        """`response_format` -> what SamplingParams.structured takes (None: plain text); a 400 naming the field.
        Whether the schema compiles is the engine's check (`LLMEngine.check_request`, at admission)."""
        try:
            fmt = None if self.response_format is None else parse_response_format(self.response_format)
            extra = parse_structured_outputs(self.structured_outputs)
        except ValueError as e:
            raise RequestError(str(e), str(e).split(":")[0].split(" ")[0]) from None
        if fmt is not None and extra is not None:
            raise RequestError("'structured_outputs': cannot be combined with a response_format other than text",
                               "structured_outputs")
        return fmt or extra

    def extra_params(self) -> dict:
        """SamplingParams fields particular to the endpoint (logprobs)."""
        return {}

    def sampling_params(self, default_max_tokens: int, num_spec_tokens: int | None = None) -> SamplingParams:
        stops = [] if self.stop is None else ([self.stop] if isinstance(self.stop, str) else list(self.stop))
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        structured = self.structured_output()
        try:  # the checks above should leave nothing for SamplingParams to refuse; if they miss one, still a 400
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, stop=stops, ignore_eos=self.ignore_eos, n=self.n,
                                  num_spec_tokens=num_spec_tokens, structured=structured, **self.extra_params())
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ")[0]) from None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # N alternatives per token (OpenAI's limit)
    best_of: int = 1
    suffix: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # None: the server default (OpenAI's is 16); 0 with echo

    NEUTRAL: ClassVar[dict] = {**_Common.NEUTRAL, "best_of": 1, "suffix": (None, "")}

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("'max_tokens' must be at least 1 (0 is allowed with 'echo': true)", "max_tokens")

    def extra_params(self) -> dict:
        """echo + logprobs scores the prompt too (`prompt_logprobs`)."""
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise RequestError(f"'prompt' holds {len(p)} prompts; this server takes one per request", "prompt",
                                   code="unsupported_parameter")
            p = p[0]
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise RequestError("'prompt' is empty", "prompt")
        return p


class ChatMessage(BaseModel):
    """One message. Roles beyond system / user / assistant, `tool_calls`, `tool_call_id` and `reasoning_content`
    exist for the DeepSeek-V4 chat format (serve/chat_format.py checks what a format takes); content parts are
    checked there too, so that a bad one is named `messages[i].content[j]`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool", "latest_reminder"]
    content: str | list | None = None
    name: str | None = None  # accepted and ignored
    tool_calls: list | None = None  # assistant: OpenAI tool calls
    tool_call_id: str | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # assistant: its reasoning (DeepSeek's API and vLLM spell it so)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Any = None  # OpenAI function tools; these four are checked by serve/chat_format.py, per chat format
    tool_choice: Any = None
    chat_template_kwargs: Any = None  # extension (vLLM): {"thinking": bool, "drop_thinking": bool}
    reasoning_effort: Any = None  # "high" | "max" (DeepSeek-V4's encoder's values), thinking mode only

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise RequestError("give 'max_tokens' or 'max_completion_tokens', not both", "max_completion_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")

    def extra_params(self) -> dict:
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def load_json(raw: bytes) -> Any:
    """Parse a request body strictly: no NaN / Infinity, nesting at most MAX_JSON_DEPTH, and no lone UTF-16
    surrogates: an escaped "\\ud800", or the raw bytes ED A0 80 (which `json.loads` decodes with
    'surrogatepass'), parse to a str that no tokenizer or UTF-8 encoder accepts; the 400 names the field."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # also bad UTF-8 and integers over Python's 4300-digit limit
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    # surrogates come from escapes or from non-ASCII bytes (raw ED A0..BF xx, or a UTF-16 / UTF-32 body): an ASCII
    # body without an escape needs no string scan
    strings = not raw.isascii() or b"\\ud" in raw.lower()
    stack = [(body, 1, None)]  # (value, depth, top-level field it is in); iterative, so depth cannot hurt here
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", field)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for k, v in items:
            name = field if field is not None or not isinstance(k, str) else _printable(k)
            if strings and any(isinstance(x, str) and _has_surrogate(x) for x in (k, v)):
                raise RequestError(f"{repr(name) if name else 'the body'} holds a lone UTF-16 surrogate (invalid "
                                   "Unicode)", name)
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, name))
    return body


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def short(value: Any, limit: int = 80, quote: bool = True) -> str:
    """repr (or, with quote=False, str) for an error message, cut: a bad 8 MB prompt must not come back in the 400
    body. Lone surrogates are escaped, so the message always encodes."""
    r = _printable(repr(value) if quote else str(value))
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode()


def parse_request(cls: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        parts = [str(x) for x in err["loc"]]
        if len(parts) > 1 and (parts[1] in ("str", "int", "float", "bool") or "[" in parts[1]):
            parts = parts[:1]  # a union branch name ('prompt.list[int]'): name the field only
            err["msg"] = f"{short(err['input'])} does not have an accepted type"
        loc = ".".join(parts)
        param = parts[0] if parts else None
        if err["type"] == "extra_forbidden":
            raise RequestError(f"unsupported field '{loc}'", param, code="unsupported_parameter") from None
        if err["type"] == "missing":
            raise RequestError(f"missing required field '{loc}'", param) from None
        raise RequestError(f"invalid value for '{loc}': {err['msg']}", param) from None
    req.check_supported()
    return req
