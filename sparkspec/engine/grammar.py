"""Structured output: a grammar matcher per request, on the host, through xgrammar (mlc-ai/xgrammar).
Legend: n drafts verified, W = ceil(V / 32) words of a token bitmask, V vocabulary.

Terms:
* **matcher** — the request's grammar state, advanced by every committed token (`LLMEngine.append`); it
  terminates when the grammar is complete and the model emits a stop token (the engine then finishes the
  request with finish_reason "stop").
* **verify masks** — for a step that verifies drafts d_0..d_{n-1}, the allowed-token bitmask of each verified
  row: row 0 from the matcher's state, row i+1 after accepting d_0..d_i; the matcher is then rolled back. The
  target's logits get -inf outside the mask before the (rejection) sampler, so every emitted token is one the
  grammar allows, and a refused draft has p(d_i) = 0: it is always rejected.
* **refused draft** — d_i the grammar does not allow after d_<i (the earlier drafts as finally verified).
  - A deterministic draft (one-hot q: n-gram, greedy requests) is cut there, with the drafts after it:
    rejecting it would draw from max(p - q, 0) = p (since p(d_i) = 0), which is exactly the bonus draw from p
    the cut list gives.
  - A sampled draft with an exact q (DSpark / MTP at T > 0) is redrawn from q masked by the grammar and
    renormalised (q_m = q · allowed / (1 - Q_refused)), and every sampled draft is verified against its q_m
    (the runner masks q on the device with the same row masks): keeping an allowed d_i and redrawing a refused
    one is together exactly a draw from q_m (P(x) = q(x) + Q_refused · q_m(x) = q_m(x)), so verification stays
    lossless (Leviathan et al., Theorem 1, with q_m as the proposal). The drafts after it were drawn given the
    old d_i: auxiliary randomness, independent of the verifier's uniforms, so they stay valid proposals with
    their own q, and are checked against the grammar in turn. The redraw reads q on the host (one small
    device->host copy per redraw) and uses the counter RNG's STREAM_GRAMMAR at the draft's position, so a
    seeded request stays reproducible. Where q has no mass on allowed tokens (q_m undefined) the draft is kept
    with its q and the masked target rejects it (p(d_i) = 0: still lossless).
  Rows past a refused draft that is kept cannot be reached (it is rejected), so their masks allow everything.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping

import torch

from sparkspec.sampling_params import StructuredOutput


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("response_format: structured output needs the xgrammar package "
                         "(pip install 'sparkspec[serve]')") from None
    return xgrammar


class GrammarBackend:
    """Compiles response formats for one tokenizer (cached per format) and makes per-request matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = import_xgrammar()
        if tokenizer is None:
            raise ValueError("response_format: structured output needs the checkpoint's tokenizer")
        hf = tokenizer.tok  # the tokenizers.Tokenizer of tokenizer.json
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
        vocab = [""] * vocab_size  # ids past the tokenizer's (a padded embedding) stay empty: never allowed
        for text, i in hf.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                vocab[i] = text
        info = xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids), add_prefix_space=meta["add_prefix_space"])
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info)
        self.compile = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, fmt: StructuredOutput):
        """-> CompiledGrammar, or ValueError naming the field (an invalid or unsupported schema / grammar)."""
        if fmt.type == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        c = self.compiler
        compile_kind = {
            # any_whitespace=False: compact JSON (", " and ": " separators), so a model cannot pad forever
            # strict_mode: properties the schema does not name are not generated (the output still validates)
            "json_schema": lambda: c.compile_json_schema(fmt.schema, any_whitespace=False, strict_mode=True),
            "regex": lambda: c.compile_regex(fmt.schema),
            "grammar": lambda: c.compile_grammar(fmt.schema),
            "choice": lambda: c.compile_grammar(choice_ebnf(json.loads(fmt.schema))),
            "structural_tag": lambda: c.compile_structural_tag(fmt.schema),
        }[fmt.type]
        try:
            return compile_kind()
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError / ...: all mean a bad input
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
            where = "response_format.json_schema.schema" if fmt.type == "json_schema" else \
                f"structured_outputs.{fmt.type}"
            raise ValueError(f"{where}: not a {KIND_NAMES[fmt.type]} xgrammar accepts ({why})") from None

    def matcher(self, fmt: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(self.xgr, self.xgr.GrammarMatcher(self.compile(fmt)), self.vocab_size)


class RequestGrammar:
    """One request's matcher, advanced by its committed tokens."""

    def __init__(self, xgr, matcher, vocab_size: int):
        self.xgr, self.matcher = xgr, matcher
        self.num_words = xgr.get_bitmask_shape(1, vocab_size)[1]  # W

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False (state unchanged) if the grammar refuses it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def verify_masks(self, drafts: list[int], cut_refused: bool,
                     redraw: Callable[[int, torch.Tensor], int | None] | None = None
                     ) -> tuple[list[int], torch.Tensor, int]:
        """-> (the drafts to verify, bitmask [n + 1, W] int32 of their rows, number of drafts redrawn):
        `check_drafts` then `row_masks`. See the module docstring. The matcher ends where it started."""
        drafts, num_redrawn = self.check_drafts(drafts, cut_refused, redraw)
        return drafts, self.row_masks(drafts), num_redrawn

    def check_drafts(self, drafts: list[int], cut_refused: bool,
                     redraw: Callable[[int, torch.Tensor], int | None] | None = None) -> tuple[list[int], int]:
        """-> (the drafts to verify, number redrawn), walking them through the matcher without making masks
        (cheap: a mask is made only for a refused draft that `redraw` replaces). `cut_refused`: drop the drafts
        from the first refused one on (deterministic drafts); else `redraw(i, mask of row i [W])` gives a
        replacement for a refused d_i (None: keep it; the walk stops there). The matcher ends where it started."""
        drafts = list(drafts)
        accepted = num_redrawn = 0
        for i, d in enumerate(drafts):
            if self.matcher.is_terminated():  # after a stop token nothing is read
                break
            if not self.matcher.accept_token(d):
                if cut_refused:
                    drafts = drafts[:i]
                    break
                new = None
                if redraw is not None:
                    row = torch.full((1, self.num_words), -1, dtype=torch.int32)
                    self.matcher.fill_next_token_bitmask(row, 0)
                    new = redraw(i, row[0])
                if new is None:
                    break
                ok = self.matcher.accept_token(new)
                assert ok, f"redrawn draft {new} outside the grammar's mask"
                drafts[i] = new
                num_redrawn += 1
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return drafts, num_redrawn

    def row_masks(self, drafts: list[int]) -> torch.Tensor:
        """-> bitmask [n + 1, W] int32 of the rows that verify `drafts` (as `check_drafts` left them): row 0 from
        the matcher's state, row i + 1 after d_0..d_i; rows past a refused draft or a stop token allow everything
        (they cannot be reached). The matcher ends where it started. This is the costly part (a mask walks the
        vocabulary): `LazyMasks` makes it run while the device computes the step's forward."""
        masks = torch.full((len(drafts) + 1, self.num_words), -1, dtype=torch.int32)  # -1: every bit set
        self.matcher.fill_next_token_bitmask(masks, 0)
        accepted = 0
        for i, d in enumerate(drafts):
            if self.matcher.is_terminated() or not self.matcher.accept_token(d):
                break
            accepted += 1
            if not self.matcher.is_terminated():  # after a stop token nothing follows: the row is not read
                self.matcher.fill_next_token_bitmask(masks, i + 1)
        if accepted:
            self.matcher.rollback(accepted)
        return masks


class LazyMasks(Mapping):
    """item -> its rows' bitmask [n + 1, W], made on first read: the keys (which items are structured) are known
    when the step is packed, the masks are read by the runner only after it has launched the forward, so on a GPU
    the host makes them while the device runs (on a CPU nothing changes). `subset(items)` is the same lazy
    masks for a part of the step, renumbered 0.. (a split step's parts)."""

    def __init__(self, make: Callable[[], dict[int, torch.Tensor]], keys, _index: dict[int, int] | None = None,
                 _cache: dict | None = None):
        self._make, self._keys = make, list(keys)
        self._index = _index  # renumbered key -> the parent's key
        self._cache = {} if _cache is None else _cache  # shared with subsets: masks are made once

    def _all(self) -> dict[int, torch.Tensor]:
        if "masks" not in self._cache:
            self._cache["masks"] = self._make()
        return self._cache["masks"]

    def __getitem__(self, key: int) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._all()[key if self._index is None else self._index[key]]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def is_made(self) -> bool:
        return "masks" in self._cache

    def subset(self, items: list[int]) -> LazyMasks | None:
        """The masks of `items` (parent keys), as keys 0..len(items)-1 in that order; None if none is structured."""
        index = {j: i if self._index is None else self._index[i] for j, i in enumerate(items) if i in self._keys}
        return LazyMasks(self._make, index, index, self._cache) if index else None


KIND_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
              "choice": "list of choices", "structural_tag": "structural tag"}


def choice_ebnf(choices: list[str]) -> str:
    """One of `choices`, exactly, as an EBNF grammar (each choice a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def parse_structured_outputs(value) -> StructuredOutput | None:
    """vLLM's `structured_outputs` request field ({"json": schema} | {"regex": str} | {"grammar": ebnf} |
    {"choice": [str, ...]} | {"structural_tag": str | object}, exactly one key) -> StructuredOutput;
    ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('structured_outputs: expected an object such as {"regex": "[0-9]+"}')
    unknown = sorted(set(value) - STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]}: unknown field (expected one of "
                         f"{', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))})")
    given = [k for k in sorted(value) if value[k] is not None]
    if len(given) != 1:
        raise ValueError("structured_outputs: give exactly one of " + ", ".join(sorted(STRUCTURED_OUTPUTS_KEYS)))
    key = given[0]
    if key == "json":
        schema = value[key]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError("structured_outputs.json: not valid JSON") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json: expected a JSON schema object")
        return StructuredOutput("json_schema", schema)
    if key == "choice" and isinstance(value[key], list):
        choices = value[key]
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice: {len(choices)} choices; at most {MAX_CHOICES} are taken")
        num_chars = sum(len(c) for c in choices if isinstance(c, str))
        if num_chars > MAX_CHOICE_CHARS:
            raise ValueError(f"structured_outputs.choice: {num_chars} characters in all; at most "
                             f"{MAX_CHOICE_CHARS} are taken")
    return StructuredOutput(key, value[key])


STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "grammar", "choice", "structural_tag"}
# A choice list compiles in time superlinear in its length (demo tokenizer, one core: 2,048 choices 0.13 s,
# 20,000 choices 12-40 s), so one 400 KB request could hold a core for a minute: longer lists are a 400.
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 1 << 16  # all choices together


def parse_response_format(value) -> StructuredOutput | None:
    """OpenAI's `response_format` -> StructuredOutput (None for {"type": "text"}); ValueError naming the field."""
    if not isinstance(value, dict):
        raise ValueError("response_format: expected an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"response_format.{extra[0]}: unknown field")
    if kind == "text" or kind == "json_object":
        if "json_schema" in value:
            raise ValueError(f"response_format.json_schema: only with type json_schema (type is {kind!r})")
        return None if kind == "text" else StructuredOutput("json_object")
    if kind != "json_schema":
        raise ValueError(f"response_format.type = {json.dumps(kind)[:80]}: expected text, json_object or json_schema")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError("response_format.json_schema: expected an object {\"name\": ..., \"schema\": {...}}")
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"response_format.json_schema.{unknown[0]}: unknown field")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise ValueError("response_format.json_schema.name: expected a non-empty string")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise ValueError("response_format.json_schema.strict: expected a boolean")
    if "schema" not in js:
        raise ValueError("response_format.json_schema.schema: missing")
    return StructuredOutput("json_schema", js["schema"], js.get("strict"))
