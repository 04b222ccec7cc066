"""Greedy identity across batching and speculation: how many requests get exactly the tokens of plain decoding
one prompt at a time. Used by the batch-invariance GPU test and its measurement script.

`python -m sparkspec.bench.identity --model checkpoints/demo --dtype bfloat16 --device cuda [--batch-invariant]
[--budgets fixed,adaptive]` prints one line per setting: `<setting>: <equal>/<prompts>` against plain decoding of
each prompt alone. `--preset bench-1b` instead builds that preset with random weights (and a random DSpark
drafter) on the device and decodes random prompts, alone and inside a batch of `--batch` mixed requests.
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


def setting_name(method: str, budget: str) -> str:
    """A speculative setting's key in `identity_counts`' result: the method alone for the fixed budget."""
    return method if budget == "fixed" else f"{method} {budget}"


def identity_counts(ckpt, prompts: list[list[int]], max_tokens: int, methods: tuple[str, ...],
                    batch_invariant: bool, num_spec_tokens: dict[str, int] | None = None,
                    log=print, budgets: tuple[str, ...] = ("fixed",)) -> dict[str, list[int]]:
    """{setting: indices of prompts whose greedy tokens differ from plain decoding one at a time}. Settings:
    "none batch" (all prompts in one batch) and each of `methods` under each of `budgets` in one batch
    (`setting_name`)."""
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
            for budget in budgets:
                k = (num_spec_tokens or {}).get(method)
                llm = LLM(ckpt, speculative=method, num_spec_tokens=k, spec_budget=budget, **common)
                out = [o.token_ids for o in llm.generate(prompts, params)]
                diff[setting_name(method, budget)] = [i for i, t in enumerate(out) if t != alone[i]]
                llm.close()
                log(f"  {setting_name(method, budget)}: done at {time.perf_counter() - t0:.1f} s")
    finally:
        set_batch_invariant(False)
    return diff


RANDOM_METHODS = ("dspark", "ngram")  # the methods a random-weight preset can run (a random DSpark drafter)


def check_random_methods(methods: tuple[str, ...]) -> None:
    if others := [m for m in methods if m not in RANDOM_METHODS]:
        raise ValueError(f"--methods {','.join(others)}: with --preset only {', '.join(RANDOM_METHODS)} run "
                         "(random drafters are DSpark's)")


def random_identity_counts(preset: str, device: str, dtype: str, num_prompts: int, batch: int, max_tokens: int,
                           methods: tuple[str, ...], budgets: tuple[str, ...], batch_invariant: bool,
                           num_spec_tokens: int | None = None, seed: int = 0, log=print) -> dict[str, list[int]]:
    """`identity_counts` on a preset with random weights (`loading.random_model`, a random DSpark drafter when
    asked): `num_prompts` random prompts of 16..256 tokens decoded one at a time, then inside one batch of `batch`
    requests (the rest random prompts of their own), plain and with each method and budget."""
    import torch

    from sparkspec.config import ModelConfig
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.random_model import random_model
    from sparkspec.ops.batch_invariant import set_batch_invariant

    check_random_methods(methods)
    cfg = ModelConfig.from_file(preset) if preset.endswith(".json") else ModelConfig.preset(preset)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, drafter = random_model(cfg, dev, getattr(torch, dtype), seed=seed,
                                  drafter="dspark" if "dspark" in methods else None)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 257, (max(batch, num_prompts),), generator=g).tolist()
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def engine(method: str = "none", budget: str = "fixed") -> LLMEngine:
        proposer = None
        if method == "dspark":
            from sparkspec.spec_decode.dspark import DSparkProposer

            proposer = DSparkProposer(model, drafter, num_spec_tokens or cfg.dspark_block_size)
        config = EngineConfig(max_num_seqs=len(prompts), max_model_len=max(lens) + max_tokens + 16,
                              speculative=method, num_spec_tokens=num_spec_tokens if method == "dspark" else None,
                              spec_budget=budget, batch_invariant=batch_invariant)
        return LLMEngine(model, None, config, {}, proposer=proposer)

    diff: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        eng = engine()
        alone = [eng.generate([p], params)[0].token_ids for p in prompts[:num_prompts]]
        log(f"  one at a time: {time.perf_counter() - t0:.1f} s")
        out = [o.token_ids for o in eng.generate(prompts, params)][:num_prompts]
        diff["none batch"] = [i for i, t in enumerate(out) if t != alone[i]]
        for method in methods:
            for budget in budgets:
                out = [o.token_ids for o in engine(method, budget).generate(prompts, params)][:num_prompts]
                diff[setting_name(method, budget)] = [i for i, t in enumerate(out) if t != alone[i]]
                log(f"  {setting_name(method, budget)}: done at {time.perf_counter() - t0:.1f} s")
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
    p.add_argument("--methods", default=None, help="comma list (default dspark,mtp,ngram; with --preset dspark,ngram)")
    p.add_argument("--dspark-k", type=int, default=7)
    p.add_argument("--budgets", default="fixed", help="comma list among fixed,adaptive")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--preset", default=None, help="a config preset with random weights instead of --model "
                   "(random prompts; the batch is --batch requests)")
    p.add_argument("--num-prompts", type=int, default=16, help="with --preset: prompts compared")
    p.add_argument("--batch", type=int, default=64, help="with --preset: requests in the batch")
    args = p.parse_args(argv)
    default = ",".join(RANDOM_METHODS) if args.preset is not None else "dspark,mtp,ngram"
    methods = tuple(m for m in (args.methods or default).split(",") if m)
    budgets = tuple(b for b in args.budgets.split(",") if b)
    if args.preset is not None:
        try:
            check_random_methods(methods)
        except ValueError as e:
            p.error(str(e))
        diff = random_identity_counts(args.preset, args.device, args.dtype, args.num_prompts, args.batch,
                                      args.max_tokens, methods, budgets, args.batch_invariant, args.dspark_k)
        total = args.num_prompts
    else:
        from sparkspec.loading.checkpoint import load_checkpoint

        ckpt = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
        prompts = identity_prompts(ckpt.tokenizer, args.per_set)
        diff = identity_counts(ckpt, prompts, args.max_tokens, methods, args.batch_invariant,
                               {"dspark": args.dspark_k}, budgets=budgets)
        total = len(prompts)
    mode = "batch-invariant" if args.batch_invariant else "default kernels"
    for name, bad in diff.items():
        print(f"{mode} | {name}: {total - len(bad)}/{total} equal to one at a time"
              + (f" (differ: {bad})" if bad else ""), flush=True)


if __name__ == "__main__":
    main()
