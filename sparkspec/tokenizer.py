"""Tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus the chat template and special tokens of
tokenizer_config.json (the offline BPE trainer is `sparkspec.loading.bpe`).

The chat template is rendered with jinja2 in a sandbox, with the variables transformers passes
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

BOS, EOS, PAD, NOISE = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>", "<|noise|>"
USER, ASSISTANT = "<|User|>", "<|Assistant|>"
# ids 0..5 in this order: BOS=0, EOS=1, PAD=2, NOISE=3 (DSpark's noise token), USER=4, ASSISTANT=5
SPECIAL_TOKENS = [BOS, EOS, PAD, NOISE, USER, ASSISTANT]

# DeepSeek-like: BOS, optional system text, then "<|User|>question<|Assistant|>answer<|end_of_sentence|>" turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)


class TokenizerError(ValueError):
    """A problem with a tokenizer directory (missing file, bad template, unknown special token)."""


def _token_text(tok: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one checkpoint."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None, source: str = "tokenizer"):
        self.tok = tokenizer
        self.config = dict(config or {})
        self.source = source
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.chat_template = self._select_template(self.config.get("chat_template"))
        for name in ("bos_token", "eos_token", "pad_token"):
            text = getattr(self, name)
            if text is not None and self.tok.token_to_id(text) is None:
                raise TokenizerError(f"{source}: {name} {text!r} is not in the vocabulary")

    @staticmethod
    def _select_template(t: Any) -> str | None:
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            return named.get("default") or next(iter(named.values()), None)
        return t if isinstance(t, str) else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: tokenizer file not found")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{tj}: cannot read tokenizer ({str(e).splitlines()[0]})") from None
        config: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            try:
                config = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{tc}: not valid JSON ({e.msg} at line {e.lineno})") from None
        jinja = path / "chat_template.jinja"  # transformers >= 4.50 writes the template here
        if jinja.is_file():
            config["chat_template"] = jinja.read_text()
        return cls(tok, config, source=str(path))

    # ---- ids ----
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tok.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tok.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.tok.token_to_id(self.pad_token)

    # ---- text ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. by the chat template) map to their ids.
        `add_special_tokens` prepends BOS (unless the text already starts with it)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """`decode` of each sequence, in one call (the Rust tokenizer decodes them in parallel, without the GIL)."""
        return self.tok.decode_batch([list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (the ones `decode(..., skip_special_tokens=True)` drops)."""
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": "user", "content": "..."}, ...]) with the checkpoint's chat template."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: tokenizer_config.json has no chat_template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] = {m!r}: expected {{'role': str, 'content': str}}")
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                pad_token=self.pad_token or "")
        except _TemplateRaised as e:
            raise ValueError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat, where only the template's own special tokens are control tokens: special-
        token text inside a message's content (a user typing "<|end_of_sentence|><|User|>") is tokenised as text,
        so no message can forge a turn.

        Special-token text in the contents is swapped for private-use placeholders before rendering (so template
        logic that edits content, e.g. trimming, still works); the rendered text is encoded with special-token
        parsing (the template's markers become their ids); then each stretch between two markers that holds a
        placeholder is re-encoded with the original text put back and special-token parsing off. Stretches without
        one keep their ids, so a chat without special-token text encodes exactly as `encode(apply_chat_template())`."""
        found = {t for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
                 for t in self._special_pattern.findall(m["content"])} if self._special_pattern else set()
        if not found:  # encode_batch releases the GIL (a long chat must not stall the server's event loop)
            return self.tok.encode_batch([self.apply_chat_template(messages, add_generation_prompt)],
                                         add_special_tokens=False)[0].ids
        taken = {c for m in messages for c in str(m.get("content", ""))} | set(self.chat_template or "")
        free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in taken)  # Unicode private-use area
        to_placeholder = {t: next(free) for t in sorted(found)}
        to_text = {ph: t for t, ph in to_placeholder.items()}
        escaped = [{**m, "content": self._special_pattern.sub(lambda x: to_placeholder[x.group()], m["content"])}
                   if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]
        text = self.apply_chat_template(escaped, add_generation_prompt)
        enc = self.tok.encode_batch([text], add_special_tokens=False)[0]
        ids, start, stretch = [], 0, []  # stretch: ids since the last marker; start: where its text begins

        def close(end: int) -> None:
            piece = text[start:end]
            if any(ph in piece for ph in to_text):
                piece = "".join(to_text.get(c, c) for c in piece)
                ids.extend(self._text_only.encode_batch([piece], add_special_tokens=False)[0].ids)
            else:
                ids.extend(stretch)

        for i, (a, b) in zip(enc.ids, enc.offsets):
            if i in self.special_ids:
                close(a)
                ids.append(i)
                start, stretch = b, []
            else:
                stretch.append(i)
        close(len(text))
        return ids

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """Matches the text of any special token (longest first); None without special tokens."""
        texts = sorted({t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}, key=len,
                       reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @functools.cached_property
    def _text_only(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as text (a copy: the flag is the tokenizer's
        state, and other threads encode prompts, which keep parsing special tokens, meanwhile)."""
        tok = HFTokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok


class IncrementalDetokenizer:
    """Text of one request's output, produced piece by piece as tokens arrive (streaming, stop strings).

    Decoding the whole output at every step costs O(length) per step; this keeps a window of the last emitted
    tokens (decoding context, so decoders that strip a leading space still see the token before) plus the
    tokens not yet shown, and decodes only that: O(new tokens) per step. A window whose text ends in U+FFFD
    stops in the middle of a multi-byte UTF-8 character: that tail is held back until a later token
    completes it, so every piece is final. Special tokens are skipped (skip_special_tokens=True), which also
    keeps a stream of them (EOS with ignore_eos) from growing the window. The pieces concatenated, plus
    `flush()` at the end, equal `tokenizer.decode(all_ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # everything emitted so far
        self.num_fed = 0  # tokens given to `feed` so far (special ones included): where a caller catches up from
        self._skip = tokenizer.special_ids
        self._window: list[int] = []  # [context tokens (already shown) | pending tokens]
        self._num_context = 0
        self._context_len: int | None = 0  # len(decode(context)); None = not computed yet

    def feed(self, ids: Iterable[int]) -> str:
        """Add new token ids -> the newly completed text ('' while a character is still incomplete)."""
        ids = list(ids)
        self.num_fed += len(ids)
        new = [i for i in ids if i not in self._skip]
        if not new:
            return ""
        self._window += new
        text = self._decode_window()
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """The held-back tail when the request ends (U+FFFD for bytes that never formed a character)."""
        return self._emit(self._decode_window()) if len(self._window) > self._num_context else ""

    def _decode_window(self) -> str:
        if self._context_len is None:
            self._context_len = len(self.tokenizer.decode(self._window[: self._num_context]))
        return self.tokenizer.decode(self._window)

    def _emit(self, text: str) -> str:
        piece = text[self._context_len :]
        self._window = self._window[self._num_context :]  # the tokens just shown become the next context
        self._num_context = len(self._window)
        self._context_len = None
        self.text += piece
        return piece


class _TemplateRaised(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateRaised(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"chat_template: jinja syntax error at line {e.lineno}: {e.message}") from None
