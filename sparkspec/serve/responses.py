"""Response bodies and SSE chunks of the two generation endpoints, for a request of n choices.

A choice's stream sends, per engine output, the text that became visible since its last chunk and the logprobs
of the tokens produced since then (the two need not line up: text is held back while it may end in a stop
string or a split UTF-8 character, logprobs are not). With `echo`, a choice's first chunk starts with the
prompt (and its logprobs). With the `sparkspec` extension asked for, each choice also carries the provenance of
its tokens (`provenance.py`), in the same token slices as the logprobs.

A chat format that structures the output (DeepSeek-V4: `ChatOutput`, serve/chat_format.py) gives the message
`reasoning_content` (thinking mode) and `tool_calls` besides `content`, and its stream parser turns each choice's
new text into `reasoning_content` / `content` / `tool_calls` deltas (a call is sent whole once its block closes;
text that may start a marker is held back until it is decided). `finish_reason` is "tool_calls" when the model
called tools and stopped by itself."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkspec.chat import Delta, StreamParser
from sparkspec.serve import logprobs as lp
from sparkspec.serve.chat_format import ChatOutput
from sparkspec.serve.provenance import Provenance


@dataclass
class ChoiceState:
    """What one choice's stream has sent: characters of text, output tokens, the legacy text offset."""

    text: int = 0
    tokens: int = 0
    offset: int = 0
    started: bool = False
    provenance: Provenance | None = None  # with the `sparkspec` extension, made by the view on first use
    parser: StreamParser | None = None  # a chat format's output parser, made by the view on first use


def usage(num_prompt: int, outs) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache held (the first
    choice's: the samples of one request share its prompt)."""
    n_out = sum(len(o.token_ids) for o in outs)
    cached = outs[0].metrics.get("num_cached_prompt_tokens", 0) if outs and outs[0].metrics else 0
    return {"prompt_tokens": num_prompt, "completion_tokens": n_out, "total_tokens": num_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


class View:
    object: str
    chunk_object: str

    def __init__(self, rid: str, model: str, tokenizer, prompt_ids: list[int], token_sources: bool = False):
        self.rid, self.model, self.tokenizer, self.prompt_ids = rid, model, tokenizer, prompt_ids
        self.token_sources = token_sources
        self.created = int(time.time())

    def with_provenance(self, choice: dict, out, tokens: slice, st: ChoiceState | None = None) -> dict:
        """Add the `sparkspec` extension to a choice when the request asked for it (and only then)."""
        if not self.token_sources:
            return choice
        st = st or ChoiceState()
        st.provenance = st.provenance or Provenance(self.tokenizer)
        end = len(out.token_ids) if tokens.stop is None else tokens.stop
        return {**choice, "sparkspec": st.provenance.extension(out, tokens.start or 0, end)}

    def has_news(self, has_text: bool, tokens: slice, finished: bool) -> bool:
        """A chunk is worth sending: new text, a finish, or (with the extension) new tokens, whose provenance the
        client waits for even while their text is held back."""
        return has_text or finished or (self.token_sources and tokens.stop > tokens.start)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, outs) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage(len(self.prompt_ids), outs)}

    def final(self, outs) -> dict:
        choices = [self.choice(i, o) for i, o in enumerate(outs)]
        return {**self.envelope(self.object, choices), "usage": usage(len(self.prompt_ids), outs)}


class CompletionView(View):
    object = chunk_object = "text_completion"

    def __init__(self, rid, model, tokenizer, prompt_ids, prompt_text: str, echo: bool, logprobs: int | None,
                 token_sources: bool = False):
        super().__init__(rid, model, tokenizer, prompt_ids, token_sources)
        self.prompt_text, self.echo, self.logprobs = prompt_text, echo, logprobs

    def logprob_obj(self, out, tokens: slice, with_prompt: bool, offset: int) -> tuple[dict | None, int]:
        if self.logprobs is None:
            return None, offset
        ids, values = out.token_ids[tokens], (out.logprobs or [])[tokens]
        if with_prompt:
            ids, values = self.prompt_ids + ids, (out.prompt_logprobs or [None] * len(self.prompt_ids)) + values
        return lp.legacy(self.tokenizer, ids, values, self.logprobs, offset)

    def choice(self, i: int, out) -> dict:
        logprobs, _ = self.logprob_obj(out, slice(None), self.echo, 0)
        text = (self.prompt_text if self.echo else "") + out.text
        return self.with_provenance({"index": i, "text": text, "logprobs": logprobs,
                                     "finish_reason": out.finish_reason}, out, slice(0, None))

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        prefix = self.echo and not st.started
        text = (self.prompt_text if prefix else "") + out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs, st.offset = self.logprob_obj(out, new, prefix, st.offset)
        st.started, st.text, st.tokens = True, len(out.text), new.stop
        if not (self.has_news(bool(text), new, out.finished) or (logprobs and logprobs["tokens"])):
            return None
        choice = {"index": i, "text": text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason if out.finished else None}
        return self.envelope(self.chunk_object, [self.with_provenance(choice, out, new, st)])


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


def _delta_fields(d: Delta) -> dict:
    fields = (("reasoning_content", d.reasoning_content), ("content", d.content), ("tool_calls", d.tool_calls))
    return {k: v for k, v in fields if v}


class ChatView(View):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid, model, tokenizer, prompt_ids, logprobs: int | None, token_sources: bool = False,
                 output: ChatOutput | None = None):
        super().__init__(rid, model, tokenizer, prompt_ids, token_sources)
        self.logprobs, self.output = logprobs, output

    def logprob_obj(self, out, tokens: slice) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": lp.chat(self.tokenizer, out.token_ids[tokens], out.logprobs[tokens], self.logprobs)}

    def message(self, out) -> tuple[dict, str | None]:
        """-> (the assistant message, finish_reason)."""
        if self.output is None:
            return {"role": "assistant", "content": out.text}, out.finish_reason
        parsed = self.output.parse(out.text)
        message = {"role": "assistant", "content": parsed.content or None}  # null without text, as vLLM
        if self.output.thinking:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message, _finish_reason(out.finish_reason, bool(parsed.tool_calls))

    def choice(self, i: int, out) -> dict:
        message, finish_reason = self.message(out)
        choice = {"index": i, "message": message, "logprobs": self.logprob_obj(out, slice(None)),
                  "finish_reason": finish_reason}
        return self.with_provenance(choice, out, slice(0, None))

    def delta(self, text: str, out, st: ChoiceState) -> tuple[dict, str | None]:
        """-> (this chunk's delta, finish_reason once finished)."""
        if self.output is None:
            return {"content": text}, out.finish_reason if out.finished else None
        st.parser = st.parser or self.output.stream_parser()
        d = st.parser.feed(text)
        if out.finished:
            rest = st.parser.finish()
            d = Delta(d.reasoning_content + rest.reasoning_content, d.content + rest.content,
                      d.tool_calls + rest.tool_calls)
        finish_reason = _finish_reason(out.finish_reason, st.parser.num_tool_calls > 0) if out.finished else None
        return _delta_fields(d), finish_reason

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        text = out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs = self.logprob_obj(out, new)
        st.text, st.tokens = len(out.text), new.stop
        delta, finish_reason = self.delta(text, out, st)
        if not (self.has_news(any(delta.values()), new, out.finished) or (logprobs and logprobs["content"])):
            return None
        if not st.started:
            delta, st.started = {"role": "assistant", **delta}, True
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.envelope(self.chunk_object, [self.with_provenance(choice, out, new, st)])
