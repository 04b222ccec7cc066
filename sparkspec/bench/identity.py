"""Greedy identity across batching and speculation: how many requests get exactly the tokens of plain decoding
one prompt at a time. Used by the batch-invariance GPU test and its measurement script.

`python -m sparkspec.bench.identity --model checkpoints/demo --dtype bfloat16 --device cuda [--batch-invariant]`
prints one line per setting: `<setting>: <equal>/<prompts>` against plain decoding of each prompt alone.
"""

from __future__ import annotations

import argparse
import time

from sparkspec.sampling_params import SamplingParams

README_PROMPT = "Write a haiku about the sea."  # the README's first command


def identity_prompts(tokenizer, per_set: int) -> list[list[int]]:
    """The README prompt and the first `per_set` prompts of each eval set (chat template applied)."""
    from sparkspec.bench.prompts import default_prompt_files, read_prompt_file

    texts = [README_PROMPT] + [t for f in default_prompt_files() for t in read_prompt_file(f)[:per_set]]
    return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]


def identity_counts(ckpt, prompts: list[list[int]], max_tokens: int, methods: tuple[str, ...],
                    batch_invariant: bool, num_spec_tokens: dict[str, int] | None = None,
                    log=print) -> dict[str, list[int]]:
    """{setting: indices of prompts whose greedy tokens differ from plain decoding one at a time}. Settings:
    "none batch" (all prompts in one batch) and each of `methods` (fixed budget) in one batch."""
    from sparkspec.engine.llm import LLM
    from sparkspec.ops.batch_invariant import set_batch_invariant

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    common = dict(batch_invariant=batch_invariant, max_num_seqs=max(len(prompts), 1),
                  max_model_len=max(len(p) for p in prompts) + max_tokens + 16)
    diff: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        llm = LLM(ckpt, **common)
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        log(f"  one at a time: {time.perf_counter() - t0:.1f} s")
        batch = [o.token_ids for o in llm.generate(prompts, params)]
        diff["none batch"] = [i for i, t in enumerate(batch) if t != alone[i]]
        llm.close()
        for method in methods:
            k = (num_spec_tokens or {}).get(method)
            llm = LLM(ckpt, speculative=method, num_spec_tokens=k, spec_budget="fixed", **common)
            out = [o.token_ids for o in llm.generate(prompts, params)]
            diff[method] = [i for i, t in enumerate(out) if t != alone[i]]
            llm.close()
            log(f"  {method}: done at {time.perf_counter() - t0:.1f} s")
    finally:
        set_batch_invariant(False)
    return diff


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="checkpoints/demo")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--per-set", type=int, default=10, help="prompts from each eval set (plus the README prompt)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default="dspark,mtp,ngram")
    p.add_argument("--dspark-k", type=int, default=7)
    p.add_argument("--batch-invariant", action="store_true")
    args = p.parse_args(argv)
    from sparkspec.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    prompts = identity_prompts(ckpt.tokenizer, args.per_set)
    methods = tuple(m for m in args.methods.split(",") if m)
    diff = identity_counts(ckpt, prompts, args.max_tokens, methods, args.batch_invariant, {"dspark": args.dspark_k})
    mode = "batch-invariant" if args.batch_invariant else "default kernels"
    for name, bad in diff.items():
        print(f"{mode} | {name}: {len(prompts) - len(bad)}/{len(prompts)} equal to one at a time"
              + (f" (differ: {bad})" if bad else ""), flush=True)


if __name__ == "__main__":
    main()
