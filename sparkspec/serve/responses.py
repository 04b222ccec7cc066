"""Response bodies and SSE chunks of the two generation endpoints, for a request of n choices.

A choice's stream sends, per engine output, the text that became visible since its last chunk and the logprobs
of the tokens produced since then (the two need not line up: text is held back while it may end in a stop
string or a split UTF-8 character, logprobs are not). With `echo`, a choice's first chunk starts with the
prompt (and its logprobs)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkspec.serve import logprobs as lp


@dataclass
class ChoiceState:
    """What one choice's stream has sent: characters of text, output tokens, the legacy text offset."""

    text: int = 0
    tokens: int = 0
    offset: int = 0
    started: bool = False


def usage(num_prompt: int, outs) -> dict:
    n_out = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": num_prompt, "completion_tokens": n_out, "total_tokens": num_prompt + n_out}


class View:
    object: str
    chunk_object: str

    def __init__(self, rid: str, model: str, tokenizer, prompt_ids: list[int]):
        self.rid, self.model, self.tokenizer, self.prompt_ids = rid, model, tokenizer, prompt_ids
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, outs) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": usage(len(self.prompt_ids), outs)}

    def final(self, outs) -> dict:
        choices = [self.choice(i, o) for i, o in enumerate(outs)]
        return {**self.envelope(self.object, choices), "usage": usage(len(self.prompt_ids), outs)}


class CompletionView(View):
    object = chunk_object = "text_completion"

    def __init__(self, rid, model, tokenizer, prompt_ids, prompt_text: str, echo: bool, logprobs: int | None):
        super().__init__(rid, model, tokenizer, prompt_ids)
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
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        prefix = self.echo and not st.started
        text = (self.prompt_text if prefix else "") + out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs, st.offset = self.logprob_obj(out, new, prefix, st.offset)
        st.started, st.text, st.tokens = True, len(out.text), new.stop
        if not (text or (logprobs and logprobs["tokens"]) or out.finished):
            return None
        return self.envelope(self.chunk_object, [{"index": i, "text": text, "logprobs": logprobs,
                                                  "finish_reason": out.finish_reason if out.finished else None}])


class ChatView(View):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid, model, tokenizer, prompt_ids, logprobs: int | None):
        super().__init__(rid, model, tokenizer, prompt_ids)
        self.logprobs = logprobs

    def logprob_obj(self, out, tokens: slice) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": lp.chat(self.tokenizer, out.token_ids[tokens], out.logprobs[tokens], self.logprobs)}

    def choice(self, i: int, out) -> dict:
        return {"index": i, "message": {"role": "assistant", "content": out.text},
                "logprobs": self.logprob_obj(out, slice(None)), "finish_reason": out.finish_reason}

    def chunk(self, i: int, out, st: ChoiceState) -> dict | None:
        text = out.text[st.text :]
        new = slice(st.tokens, len(out.token_ids))
        logprobs = self.logprob_obj(out, new)
        st.text, st.tokens = len(out.text), new.stop
        if not (text or (logprobs and logprobs["content"]) or out.finished):
            return None
        delta = {"content": text}
        if not st.started:
            delta, st.started = {"role": "assistant", **delta}, True
        return self.envelope(self.chunk_object, [{"index": i, "delta": delta, "logprobs": logprobs,
                                                  "finish_reason": out.finish_reason if out.finished else None}])
