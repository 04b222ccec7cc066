"""`sparkspec train tokenizer | data | target | regenerate | dspark | mtp | calibrate`.

The lead's `sparkspec/cli.py` calls `add_train_parser(subparsers)`; every sub-command sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _budget_args(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps (upper bound)")
    p.add_argument("--minutes", type=float, default=None, help="wall-time budget; the LR schedule follows it")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda | cpu | ... (default: the platform's accelerator)")
    p.add_argument("--save-every", type=int, default=500, help="resumable state every N steps (0 = never)")


def add_train_parser(subparsers) -> None:
    t = subparsers.add_parser("train", help="train a tokenizer, a target, or DSpark / MTP drafters; calibrate")
    sub = t.add_subparsers(dest="train_command", required=True)

    s = sub.add_parser("tokenizer", help="byte-level BPE + chat template from ShareGPT (eval prompts excluded)")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--vocab-size", type=int, default=4096)
    s.add_argument("--max-chars", type=int, default=20_000_000)
    s.set_defaults(func=cmd_tokenizer)

    s = sub.add_parser("data", help="tokenise ShareGPT: pretrain.npy, distill.jsonl, heldout.jsonl")
    s.add_argument("--tokenizer", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--max-tokens", type=int, default=20_000_000)
    s.set_defaults(func=cmd_data)

    s = sub.add_parser("target", help="pre-train a DeepSeek-V4-architecture target from a token stream")
    s.add_argument("--preset", default="demo", help="preset name or config.json path")
    s.add_argument("--data", type=Path, required=True, help="uint16 .npy token stream (`train data`)")
    s.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir copied into the checkpoint")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--heldout", type=Path, default=None,
                   help="held-out token stream (default: heldout.npy beside --data, else its last 1%%)")
    s.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="fuse the elementwise-heavy ops with torch.compile (default: on accelerators)")
    s.add_argument("--no-write", dest="write", action="store_false",
                   help="report the held-out loss only, write no checkpoint (scaling runs)")
    _budget_args(s, 3000, 2e-3)
    s.set_defaults(func=cmd_target)

    s = sub.add_parser("regenerate", help="answer training prompts with the target (DeepSpec data recipe)")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--prompts", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperatures", default="0", help="comma list cycled over prompts, e.g. 0,1")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--shard", default="0/1", help="I/N: this process answers prompts i with i %% N == I")
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None)
    s.set_defaults(func=cmd_regenerate)

    for kind in ("dspark", "mtp"):
        s = sub.add_parser(kind, help=f"distil a {'DSpark' if kind == 'dspark' else 'MTP'} drafter from the target")
        s.add_argument("--model", type=Path, required=True, help="target checkpoint dir (drafter is written here)")
        s.add_argument("--data", type=Path, required=True, help="regenerated answers (`train regenerate`)")
        s.add_argument("--out", type=Path, default=None, help="checkpoint dir to write (default: --model)")
        s.add_argument("--batch-size", type=int, default=16, help="sequences per step")
        s.add_argument("--max-len", type=int, default=640, help="truncate prompt+answer to this many tokens")
        s.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="fuse the elementwise-heavy ops with torch.compile (default: on accelerators)")
        if kind == "dspark":
            s.add_argument("--anchors", type=int, default=64, help="random anchors (blocks) per sequence")
        _budget_args(s, 2000, 6e-4 if kind == "dspark" else 1e-3)
        s.set_defaults(func=cmd_dspark if kind == "dspark" else cmd_mtp)

    s = sub.add_parser("calibrate", help="sequential temperature scaling of the DSpark confidence head")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--data", type=Path, required=True, help="held-out regenerated answers")
    s.add_argument("--anchors", type=int, default=32)
    s.add_argument("--max-seqs", type=int, default=256)
    s.add_argument("--max-len", type=int, default=640)
    s.add_argument("--temperature", type=float, default=0.0, help="drafting temperature of the rollouts")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None)
    s.set_defaults(func=cmd_calibrate)


def _config(preset: str):
    from sparkspec.config import ModelConfig

    return ModelConfig.from_file(preset) if preset.endswith(".json") else ModelConfig.preset(preset)


def _report(name: str, result: dict, t0: float) -> int:
    print(json.dumps({k: v for k, v in result.items() if k != "log"}))
    print(f"{name}: done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def cmd_tokenizer(args) -> int:
    from sparkspec.train.tokenizer import train_tokenizer

    t0 = time.perf_counter()
    tok = train_tokenizer(args.out, args.vocab_size, args.max_chars)
    return _report("tokenizer", {"vocab_size": tok.vocab_size, "out": str(args.out)}, t0)


def cmd_data(args) -> int:
    from sparkspec.tokenizer import Tokenizer
    from sparkspec.train.data import prepare_data

    t0 = time.perf_counter()
    return _report("data", prepare_data(Tokenizer.from_dir(args.tokenizer), args.out, args.max_tokens), t0)


def cmd_target(args) -> int:
    from sparkspec.train.target import train_target

    t0 = time.perf_counter()
    res = train_target(_config(args.preset), args.data, args.out, args.tokenizer, args.steps, args.minutes,
                       args.batch_size, args.seq_len, args.lr, args.seed, args.device, args.save_every,
                       heldout=args.heldout, compile=args.compile, write=args.write)
    return _report("target", res, t0)


def cmd_regenerate(args) -> int:
    from sparkspec.train.target import regenerate

    t0 = time.perf_counter()
    i, n = (int(x) for x in args.shard.split("/"))
    temps = [float(x) for x in args.temperatures.split(",")]
    count = regenerate(args.model, args.prompts, args.out, args.max_tokens, temps, args.batch_size, (i, n),
                       args.limit, args.seed, args.device)
    return _report("regenerate", {"answers": count, "out": str(args.out)}, t0)


def cmd_dspark(args) -> int:
    from sparkspec.train.dspark import train_dspark

    t0 = time.perf_counter()
    res = train_dspark(args.model, args.data, args.out or args.model, steps=args.steps, minutes=args.minutes,
                       batch_size=args.batch_size, max_len=args.max_len, anchors=args.anchors, lr=args.lr,
                       seed=args.seed, device=args.device, save_every=args.save_every, compile=args.compile)
    return _report("dspark", res, t0)


def cmd_mtp(args) -> int:
    from sparkspec.train.mtp import train_mtp

    t0 = time.perf_counter()
    res = train_mtp(args.model, args.data, args.out or args.model, steps=args.steps, minutes=args.minutes,
                    batch_size=args.batch_size, max_len=args.max_len, lr=args.lr, seed=args.seed,
                    device=args.device, save_every=args.save_every, compile=args.compile)
    return _report("mtp", res, t0)


def cmd_calibrate(args) -> int:
    from sparkspec.train.calibrate import calibrate_checkpoint

    t0 = time.perf_counter()
    res = calibrate_checkpoint(args.model, args.data, anchors=args.anchors, max_seqs=args.max_seqs,
                               max_len=args.max_len, temperature=args.temperature, seed=args.seed,
                               device=args.device)
    return _report("calibrate", res, t0)
