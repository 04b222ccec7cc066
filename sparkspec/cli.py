"""`sparkspec init | generate | serve | bench | train | eval`.

User errors (bad flags, missing files, bad config fields, bad prompts) print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"


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
    g.add_argument("--spec", choices=["none", "dspark", "mtp", "ngram"], default=None,
                   help="speculative method (default: dspark when the checkpoint has DSpark weights)")
    g.add_argument("--num-spec-tokens", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(func=cmd_generate)

    _add_optional(sub, "sparkspec.serve.cli", "add_serve_parser")
    _add_optional(sub, "sparkspec.bench.cli", "add_bench_parser")
    _add_optional(sub, "sparkspec.train.cli", "add_train_parser")
    _add_optional(sub, "sparkspec.bench.eval", "add_eval_parser")
    return p


def cmd_init(args) -> int:
    from sparkspec.checkpoint import init_checkpoint

    t0 = time.perf_counter()
    init_checkpoint(args.preset, args.out, seed=args.seed, drafter=args.drafter, shard_size_bytes=args.shard_size)
    print(f"wrote {args.preset} checkpoint to {args.out} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


def read_prompts(args, tokenizer) -> list[tuple[str | None, list[int]]]:
    """-> [(prompt text or None, prompt token ids)]."""
    items: list[tuple[str | None, list[int]]] = []

    def from_text(text: str, chat: bool) -> tuple[str, list[int]]:
        if tokenizer is None:
            raise UserError(f"{args.model}: no tokenizer.json; pass prompt_token_ids in --prompts-file")
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return text, tokenizer.encode(text, add_special_tokens=not chat)

    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise UserError(f"prompts file not found: {args.prompts_file}")
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
                items.append((None, ids))
            elif isinstance(obj.get("prompt"), str):
                items.append(from_text(obj["prompt"], args.chat))
            elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
                items.append(from_text(obj["turns"][0], True))
            else:
                raise UserError(f"{where}: expected 'prompt', 'prompt_token_ids' or 'turns'")
    else:
        for text in args.prompt or ["The quick brown fox"]:
            items.append(from_text(text, args.chat))
    if not items:
        raise UserError("no prompts given")
    return items


def cmd_generate(args) -> int:
    import torch

    from sparkspec.checkpoint import load_checkpoint
    from sparkspec.sampling_params import SamplingParams

    if not args.model.exists():
        raise UserError(f"model directory not found: {args.model}")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise UserError(str(e)) from None
    device = torch.device(args.device) if args.device else None
    ckpt = load_checkpoint(args.model, device=device, progress=True)
    prompts = read_prompts(args, ckpt.tokenizer)
    for i, (_, ids) in enumerate(prompts):
        if len(ids) >= ckpt.config.max_position_embeddings:
            raise UserError(f"prompt {i}: {len(ids)} tokens exceeds max_position_embeddings="
                            f"{ckpt.config.max_position_embeddings}")
    method = args.spec
    if method is None:
        method = "dspark" if _has_dspark(ckpt) else "none"
    if method == "none":
        from sparkspec.generation import Generator

        gen = Generator(ckpt.model, ckpt.tokenizer)
    else:
        from sparkspec.spec_decode import SpeculativeGenerator, build_proposer

        try:
            proposer = build_proposer(method, ckpt.model, ckpt.drafter_tensors, args.num_spec_tokens)
        except ValueError as e:
            raise UserError(str(e)) from None
        gen = SpeculativeGenerator(ckpt.model, ckpt.tokenizer, proposer)
    t0 = time.perf_counter()
    try:
        seqs = gen.generate([ids for _, ids in prompts], params)
    except ValueError as e:
        raise UserError(str(e)) from None
    total = time.perf_counter() - t0
    for (text, ids), s in zip(prompts, seqs):
        elapsed = (s.end_time or time.perf_counter()) - s.start_time
        if ckpt.tokenizer is not None and not s.text:
            s.text = ckpt.tokenizer.decode(s.output_ids, skip_special_tokens=True)
        if args.json:
            metrics = getattr(s, "spec_metrics", None)
            print(json.dumps({
                "prompt": text, "prompt_token_ids": ids, "token_ids": s.output_ids, "text": s.text,
                "num_prompt_tokens": len(ids), "num_generated_tokens": len(s.output_ids),
                "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(len(s.output_ids) / max(elapsed, 1e-9), 2),
                "spec": metrics.to_dict() if metrics is not None else None,
            }))
        else:
            print(s.text)
    if not args.json:
        n = sum(len(s.output_ids) for s in seqs)
        line = f"[{len(seqs)} prompts, {n} tokens in {total:.2f}s, {n / max(total, 1e-9):.1f} tok/s, spec={method}"
        agg = getattr(gen, "aggregate_metrics", None)
        if callable(agg):
            m = agg(seqs).to_dict()
            line += f", tau={m['acceptance_length']:.2f}"
        print(line + "]", file=sys.stderr)
    return 0


def _has_dspark(ckpt) -> bool:
    return ckpt.config.has_dspark and any(k.endswith("main_proj.weight") for k in ckpt.drafter_tensors)


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
