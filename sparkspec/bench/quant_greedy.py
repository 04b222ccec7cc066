"""Greedy tokens of the quantised weights against the same weights dequantised: where they part, whether the
dequantised model stood at a near-tie there.

    python -m sparkspec.bench.quant_greedy --preset deepseek-v4-flash --num-layers 4 --num-prompts 8 --max-tokens 32

Builds the preset's first N target layers with random weights in the official quantised layout (FP8 attention and
shared-expert projections, FP4 routed experts: `random_model(..., quantization="keep")`), decodes random prompts
greedily through the quantised kernels, then replaces every quantised layer by a `--dtype` `nn.Linear` holding its
exact dequantised weight (`loading.quantized.dequantize_layers_`) and decodes the same prompts again, with the top
two log-probabilities of every token. A prompt whose tokens differ reports the first position where they do, the
dequantised model's top-2 gap there (log-probabilities of greedy rows are the raw logits' log-softmax, so the gap
is the logit gap), and whether the quantised path took the dequantised model's second choice. Prints one line per
prompt and a summary; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import time


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def top2_gap(logprobs: dict[int, float]) -> tuple[float, int | None]:
    """(top-1 minus top-2 log-probability, the second token) of one position's `logprobs` entry (inf, None with
    one candidate)."""
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    if len(ranked) < 2:
        return float("inf"), None
    return ranked[0][1] - ranked[1][1], ranked[1][0]


def compare(quantized: list[list[int]], reference: list[list[int]], ref_logprobs: list[list[dict[int, float]]],
            near_tie: float) -> list[dict]:
    """Per prompt: equal, or where the quantised tokens part from the reference's and how close the reference's
    choice was there."""
    rows = []
    for i, (got, want, lps) in enumerate(zip(quantized, reference, ref_logprobs)):
        at = first_difference(got, want)
        row = {"prompt": i, "equal": at is None}
        if at is not None and at < len(want) and at < len(got):
            gap, second = top2_gap(lps[at])
            row |= {"first_difference": at, "top2_gap": round(gap, 6), "took_second": got[at] == second,
                    "near_tie": gap < near_tie}
        elif at is not None:
            row |= {"first_difference": at, "top2_gap": None, "took_second": False, "near_tie": False}
        rows.append(row)
    return rows


def run(preset: str, num_layers: int | None, device: str | None, dtype: str, num_prompts: int, prompt_len: int,
        max_tokens: int, seed: int = 0, log=print) -> tuple[list[list[int]], list[list[int]], list]:
    """-> (quantised tokens, dequantised tokens, dequantised top-2 logprobs) per prompt."""
    import torch

    from sparkspec.bench.latency import truncated
    from sparkspec.config import ModelConfig
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.quantized import dequantize_layers_
    from sparkspec.loading.random_model import random_model
    from sparkspec.sampling_params import SamplingParams

    cfg = ModelConfig.from_file(preset) if preset.endswith(".json") else ModelConfig.preset(preset)
    cfg = truncated(cfg, num_layers)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model, _ = random_model(cfg, dev, getattr(torch, dtype), seed=seed, quantization="keep")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    config = dict(max_num_seqs=num_prompts, max_model_len=prompt_len + max_tokens + 16)

    def decode(logprobs: int | None):
        engine = LLMEngine(model, None, EngineConfig(**config))
        out = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs))
        return [o.token_ids for o in out], [o.logprobs for o in out]

    quantized, _ = decode(None)
    log(f"  quantised: done at {time.perf_counter() - t0:.1f} s")
    replaced = dequantize_layers_(model, getattr(torch, dtype))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    reference, logprobs = decode(2)
    log(f"  dequantised ({len(replaced)} layers): done at {time.perf_counter() - t0:.1f} s")
    return quantized, reference, logprobs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v4-flash", help="config preset (random weights)")
    p.add_argument("--num-layers", type=int, default=4, help="the first N target layers")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16", help="activations, and the dequantised weights")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--near-tie", type=float, default=1e-2, help="a top-2 gap below this is a near-tie")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    quantized, reference, logprobs = run(args.preset, args.num_layers, args.device, args.dtype, args.num_prompts,
                                         args.prompt_len, args.max_tokens)
    rows = compare(quantized, reference, logprobs, args.near_tie)
    for r in rows:
        print(f"prompt {r['prompt']}: " + ("equal" if r["equal"] else
              f"first difference at token {r['first_difference']}, dequantised top-2 gap {r['top2_gap']}"
              + (" (the quantised path took its second choice)" if r["took_second"] else "")), flush=True)
    equal = sum(r["equal"] for r in rows)
    ties = sum(not r["equal"] and r["near_tie"] for r in rows)
    print(f"{equal}/{len(rows)} equal; {ties} differ at a near-tie (gap < {args.near_tie}); "
          f"{len(rows) - equal - ties} differ otherwise")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
