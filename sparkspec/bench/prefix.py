"""`sparkspec bench prefix`: what prefix caching buys a chat. Turn 1 is a long system prompt and a question; turn 2
resends it with the reply and a new question (what a chat client does), so it shares nearly all of turn 1. Per
speculative method, with the cache on and off: the TTFT of each turn and turn 2 / turn 1, the tokens shared and
the tokens the cache held (`EngineStats.num_prefix_cache_hits`). Prints the table; writes JSON where `--json`
says."""

from __future__ import annotations

import argparse
import time

from sparkspec.bench.common import table_head, table_row, write_json

FIT_QUESTION = "Which shelf holds item 42?"  # the question the system prompt is cut to fit with


def long_chat(tok, prefix_tokens: int, question: str = FIT_QUESTION) -> list[dict]:
    """A system prompt (numbered notes, cut to fit) and `question`: about `prefix_tokens` tokens in all. The same
    `prefix_tokens` gives the same system prompt whatever the question (`bench offline --shared-prefix-tokens`)."""
    system = " ".join(f"Note {i}: the archive keeps item {i * 37 % 101} on shelf {i % 9}, checked on day {i % 28}."
                      for i in range(max(8, prefix_tokens // 8)))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": FIT_QUESTION}]
    while len(tok.encode_chat(msgs)) > prefix_tokens and len(system) > 64:
        system = system[: int(len(system) * 0.97)]
        msgs[0]["content"] = system
    msgs[1]["content"] = question
    return msgs


def run(args) -> list[dict]:
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.sampling_params import SamplingParams

    ckpt = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    tok = ckpt.tokenizer
    msgs = long_chat(tok, args.prefix_tokens)
    first = tok.encode_chat(msgs)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for method in args.spec:
        for caching in (True, False):
            eng = LLMEngine(ckpt.model, tok, EngineConfig(max_num_seqs=4, speculative=method, spec_budget="fixed",
                                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                                          enable_prefix_caching=caching), ckpt.drafter_tensors)
            eng.generate([first[:64][::-1]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            t0 = time.perf_counter()
            o1 = eng.generate([first], params)[0]
            reply = tok.decode(o1.token_ids, skip_special_tokens=True)
            second = tok.encode_chat(msgs + [{"role": "assistant", "content": reply},
                                             {"role": "user", "content": "And item 7?"}])
            o2 = eng.generate([second], params)[0]
            ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in (o1, o2)]
            shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
            rows.append({"method": method, "prefix_caching": caching, "turn1_tokens": len(first),
                         "turn2_tokens": len(second), "shared_tokens": shared,
                         "turn2_cached_tokens": o2.metrics["num_cached_prompt_tokens"],
                         "ttft1_s": round(ttft[0], 4), "ttft2_s": round(ttft[1], 4),
                         "ttft_ratio": round(ttft[1] / ttft[0], 4), "seconds": round(time.perf_counter() - t0, 2)})
            print(f"  {method} caching={caching}: {rows[-1]['ttft1_s']} s -> {rows[-1]['ttft2_s']} s", flush=True)
    return rows


def add_prefix_parser(subparsers) -> argparse.ArgumentParser:
    from sparkspec.paths import DEFAULT_MODEL

    p = subparsers.add_parser("prefix", help="TTFT of a chat's second turn with prefix caching on and off")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory (default: the demo)")
    p.add_argument("--spec", default="none,dspark", help="comma-separated speculative methods")
    p.add_argument("--prefix-tokens", type=int, default=2040, help="about this many prompt tokens in turn 1")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="prefill chunk")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    args.spec = [s for s in args.spec.split(",") if s]
    rows = run(args)
    cols = ["method", "prefix_caching", "turn1_tokens", "turn2_tokens", "shared_tokens", "turn2_cached_tokens",
            "ttft1_s", "ttft2_s", "ttft_ratio"]
    print(table_head(cols))
    for r in rows:
        print(table_row(r[c] for c in cols))
    if args.json:
        write_json(args.json, rows, {"kind": "prefix", "model": args.model, "prefix_tokens": args.prefix_tokens})
    return 0
