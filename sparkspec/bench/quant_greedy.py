"""Greedy tokens of quantised weights against the same weights dequantised, and the top-2 gap where they part.

    python -m sparkspec.bench.quant_greedy --preset deepseek-v4-flash --num-layers 4 --num-prompts 8 --max-tokens 32

Builds the preset's first N target layers with random weights in the official quantised layout (FP8 attention and
shared-expert projections, FP4 routed experts: `random_model(..., quantization="keep")`), decodes random prompts
greedily through the quantised kernels, then replaces every quantised layer by a `--dtype` `nn.Linear` holding its
exact dequantised weight (`loading.quantized.dequantize_layers_`) and decodes the same prompts again, with the top
two log-probabilities of every token. A prompt whose tokens differ reports the first position where they do, the
dequantised model's top-2 gap there (log-probabilities of greedy rows are the raw logits' log-softmax, so the gap
is the logit gap), and whether the quantised path took the dequantised model's second choice. Prints one line per
prompt and a summary; `--json` writes them.

FP8 activations: on CUDA (sm90 / sm100) a step of at least `ops.quant.SCALED_MM_MIN_ROWS` rows (a prefill of
8 x 128 tokens is one) runs the FP8 linears on cuBLAS with the activations quantised to e4m3 per 1 x 128 block (the
DeepSeek recipe), which the dequantised model does not do: that rounding, not the kernels, then parts the tokens.
`--fp8-activations off` (the default) keeps the activations in `--dtype` in every step, so the two models differ
only by where the kernels round; `on` measures the recipe as served.

The noise floor (`--noise-floor`): in bf16 two correct GEMM implementations round in different orders, and over
a few random layers greedy tokens then part where the logits are close. The dequantised model decoded again one
prompt at a time (other row counts: cuBLAS picks other kernels) against itself decoded in one batch measures how
often that alone parts them; the quantised rows are judged against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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


@contextlib.contextmanager
def fp8_activations(on: bool):
    """The FP8 linears' activation quantisation (`SPARKSPEC_FP8_ACTIVATIONS`, read per call) on or off inside."""
    before = os.environ.get("SPARKSPEC_FP8_ACTIVATIONS")
    os.environ["SPARKSPEC_FP8_ACTIVATIONS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARKSPEC_FP8_ACTIVATIONS")
        else:
            os.environ["SPARKSPEC_FP8_ACTIVATIONS"] = before


def run(preset: str, num_layers: int | None, device: str | None, dtype: str, num_prompts: int, prompt_len: int,
        max_tokens: int, seed: int = 0, log=print, quantize_activations: bool = False, enforce_eager: bool = False,
        noise_floor: bool = False) -> tuple[list[list[int]], list[list[int]], list, list[list[int]] | None]:
    """-> (quantised tokens, dequantised tokens, dequantised top-2 logprobs, dequantised tokens of each prompt
    decoded alone where `noise_floor`, else None) per prompt. `quantize_activations`: let the quantised model's
    large steps quantise the FP8 linears' inputs (module docstring)."""
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
    config = dict(max_num_seqs=num_prompts, max_model_len=prompt_len + max_tokens + 16, enforce_eager=enforce_eager)

    def decode(logprobs: int | None, batches: list[list[list[int]]]):
        engine = LLMEngine(model, None, EngineConfig(**config))  # one engine (one graph capture) per pass
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        out = [o for batch in batches for o in engine.generate(batch, params)]
        return [o.token_ids for o in out], [o.logprobs for o in out]

    with fp8_activations(quantize_activations):
        quantized, _ = decode(None, [prompts])
    log(f"  quantised (FP8 activations {'on' if quantize_activations else 'off'}): done at "
        f"{time.perf_counter() - t0:.1f} s")
    replaced = dequantize_layers_(model, getattr(torch, dtype))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    reference, logprobs = decode(2, [prompts])
    log(f"  dequantised ({len(replaced)} layers): done at {time.perf_counter() - t0:.1f} s")
    alone = None
    if noise_floor:
        alone, _ = decode(None, [[prompt] for prompt in prompts])
        log(f"  dequantised, one prompt at a time: done at {time.perf_counter() - t0:.1f} s")
    return quantized, reference, logprobs, alone


def summary(rows: list[dict], near_tie: float) -> str:
    equal = sum(r["equal"] for r in rows)
    ties = sum(not r["equal"] and r["near_tie"] for r in rows)
    return (f"{equal}/{len(rows)} equal; {ties} differ at a near-tie (gap < {near_tie}); "
            f"{len(rows) - equal - ties} differ otherwise")


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
    p.add_argument("--fp8-activations", choices=["off", "on"], default="off",
                   help="on: large steps quantise the FP8 linears' inputs to e4m3 as served (see the module doc); "
                        "off: inputs stay in --dtype, so only the kernels' rounding differs")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (compiles only the shapes run)")
    p.add_argument("--noise-floor", action="store_true",
                   help="also decode the dequantised model one prompt at a time and compare it with its own batched "
                        "tokens: how often rounding order alone parts greedy tokens (module docstring)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    quantized, reference, logprobs, alone = run(args.preset, args.num_layers, args.device, args.dtype,
                                                args.num_prompts, args.prompt_len, args.max_tokens,
                                                quantize_activations=args.fp8_activations == "on",
                                                enforce_eager=args.enforce_eager, noise_floor=args.noise_floor)
    rows = compare(quantized, reference, logprobs, args.near_tie)
    for r in rows:
        print(f"prompt {r['prompt']}: " + ("equal" if r["equal"] else
              f"first difference at token {r['first_difference']}, dequantised top-2 gap {r['top2_gap']}"
              + (" (the quantised path took its second choice)" if r["took_second"] else "")), flush=True)
    print(f"quantised vs dequantised: {summary(rows, args.near_tie)}")
    out = {"args": vars(args), "rows": rows}
    if alone is not None:
        out["noise_floor"] = compare(alone, reference, logprobs, args.near_tie)
        print(f"noise floor, dequantised alone vs in one batch: {summary(out['noise_floor'], args.near_tie)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
