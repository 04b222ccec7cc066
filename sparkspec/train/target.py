"""`sparkspec train target`: pre-train a small DeepSeek-V4-architecture model (every attention kind, hash +
routed MoE, mHC: the model class the engine serves) on a packed token stream, and
`sparkspec train regenerate`: let a trained target answer the drafter's training prompts.

The training forward is the serving model itself: the windows packed back to back from position 0 through a
fresh paged cache (`forward_sequences`), so no second model definition can drift from the one we serve.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sparkspec.config import ModelConfig
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import forward_sequences
from sparkspec.train import common


def init_target(cfg: ModelConfig, seed: int) -> DeepseekV4Model:
    """fp32 model with the random-checkpoint init, head and residual outputs scaled down for training."""
    from sparkspec.loading.random_init import random_target_tensors
    from sparkspec.loading.state import load_state

    tensors = random_target_tensors(cfg, torch.Generator().manual_seed(seed))
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, t in tensors.items():
        if name == "head.weight":
            t.mul_(0.25)  # start near uniform logits
        elif name.endswith(("attn.wo_b.weight", ".w2.weight")):
            t.mul_(depth_scale)
    model = DeepseekV4Model(cfg)
    load_state(model, tensors, source="init")
    return model


IGNORE = -100  # label of a sequence's last row: its next token opens another document


@dataclass
class Packed:
    """A training batch: windows cut before every document start into sequences of their own (document
    masking: no token attends across a conversation boundary, and every conversation starts at position 0)."""

    ids: np.ndarray  # [T] int64, the sequences back to back
    labels: np.ndarray  # [T] int64 the next token of the same sequence, IGNORE where there is none
    lengths: np.ndarray  # [S] rows of each sequence

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE).sum())

    def loss(self, model: DeepseekV4Model, reduction: str = "mean") -> torch.Tensor:
        out = forward_sequences(model, self.ids, self.lengths)
        labels = torch.from_numpy(self.labels).to(out.logits.device, non_blocking=True)
        return F.cross_entropy(out.logits.float(), labels, ignore_index=IGNORE, reduction=reduction)


def pack_windows(stream: np.ndarray, starts: np.ndarray, seq_len: int, bos_id: int | None) -> Packed:
    """Windows stream[s : s + seq_len + 1] for s in `starts`, split before every BOS (a document's first token)."""
    w = np.stack([np.asarray(stream[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    inputs, labels = w[:, :-1], w[:, 1:].copy()
    cut = np.zeros(inputs.shape, dtype=bool)
    cut[:, 0] = True
    if bos_id is not None:
        cut |= inputs == bos_id
        labels[labels == bos_id] = IGNORE
    first = np.flatnonzero(cut.ravel())
    return Packed(inputs.ravel(), labels.ravel(), np.diff(np.append(first, inputs.size)))


def train_target(cfg: ModelConfig, data: Path, out_dir: Path, tokenizer_dir: Path | None, steps: int,
                 minutes: float | None, batch_size: int, seq_len: int, lr: float, seed: int = 0,
                 device: str | None = None, save_every: int = 500, shard_mb: int = 14,
                 heldout: Path | None = None, compile: bool | None = None, write: bool = True) -> dict:
    """Train, checkpoint every `save_every` steps (resumable from `out_dir/train_state.pt`), write the final
    checkpoint (bf16, official layout, shards <= shard_mb) and `train_log_target.json` (`write=False`: neither,
    a scaling run). Returns the log summary.

    Held-out loss: on `heldout` (default: `heldout.npy` beside `data`, written by `train data`; else the last
    1 % of `data`), in nats per token and, with `counts.json` beside it, in bits per byte. `compile`: run the
    elementwise-heavy ops through torch.compile (default: on accelerators)."""
    from sparkspec.loading.save import write_checkpoint

    dev = common.pick_device(device)
    common.use_native_ops(compile=dev.type != "cpu" if compile is None else compile)
    common.seed_everything(seed)
    stream = np.load(data, mmap_mode="r")
    if stream.max(initial=0) >= cfg.vocab_size:
        raise ValueError(f"{data}: token id {int(stream.max())} >= vocab_size={cfg.vocab_size}")
    heldout = heldout or (data.parent / "heldout.npy")
    if heldout.is_file():
        train_stream, val_stream = np.asarray(stream), np.asarray(np.load(heldout, mmap_mode="r"))
    else:
        split = int(len(stream) * 0.99)
        train_stream, val_stream = np.asarray(stream[:split]), np.asarray(stream[split:])
    cfg.torch_dtype = "float32"
    model = init_target(cfg, seed).to(dev)
    model.train()
    opt = common.adamw(model.parameters(), lr, weight_decay=0.1)
    tokens_per_step = batch_size * seq_len
    loop = common.TrainLoop("target", model, opt, lr, steps, minutes, dev, out_dir, save_every, tokens_per_step)
    rng = np.random.default_rng(seed + loop.step)

    def loss_terms() -> dict[str, torch.Tensor]:
        batch = pack_windows(train_stream, rng.integers(0, len(train_stream) - seq_len - 1, size=batch_size),
                             seq_len, cfg.bos_token_id)
        return {"loss": batch.loss(model)}

    loop.run(loss_terms)
    step, log, train_time = loop.step, loop.log, loop.budget.elapsed
    model.eval()
    val = evaluate_lm(model, val_stream, batch_size, seq_len, dev, cfg.bos_token_id)
    meta = {"steps": step, "time_s": round(train_time, 1), "batch_size": batch_size, "seq_len": seq_len,
            "tokens_seen": step * tokens_per_step, "tokens_per_s": round(loop.tokens_per_s), "lr": lr, "val_loss": val,
            "val_bits_per_byte": bits_per_byte(val, heldout), "data": str(data),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3)}
    if write:
        write_checkpoint(model, cfg, out_dir, tokenizer_dir=tokenizer_dir, shard_size_bytes=shard_mb << 20,
                         dtype="bfloat16")
        (out_dir / common.STATE_FILE).unlink(missing_ok=True)
        log.write(out_dir / "train_log_target.json", **meta)
    return {**log.summary(), **meta}


@torch.no_grad()
def evaluate_lm(model: DeepseekV4Model, stream: np.ndarray, batch_size: int, seq_len: int, dev: torch.device,
                bos_id: int | None = None, max_tokens: int = 1 << 21) -> float:
    """Mean next-token loss (nats) over consecutive windows of `stream` (up to `max_tokens`), packed as in
    training."""
    starts = np.arange(0, max(len(stream) - seq_len - 1, 0), seq_len)[: max(1, max_tokens // seq_len)]
    total, count = 0.0, 0
    for b in range(0, len(starts), batch_size):
        batch = pack_windows(stream, starts[b : b + batch_size], seq_len, bos_id)
        with common.autocast(dev):
            total += batch.loss(model, reduction="sum").item()
        count += batch.num_targets
    return round(total / max(count, 1), 4)


def bits_per_byte(loss: float, heldout: Path) -> float | None:
    """Nats per token -> bits per byte of the held-out text (`counts.json` beside it: its tokens and bytes)."""
    counts = heldout.parent / "counts.json"
    if heldout.name != "heldout.npy" or not counts.is_file():
        return None
    c = json.loads(counts.read_text())
    if not c.get("heldout_bytes"):
        return None
    return round(loss / math.log(2) * c["heldout_tokens"] / c["heldout_bytes"], 4)


# ---------------------------------------------------------------- answer regeneration


def regenerate(model_dir: Path, prompts: Path, out: Path, max_tokens: int, temperatures: list[float],
               batch_size: int, shard: tuple[int, int] = (0, 1), limit: int | None = None, seed: int = 0,
               device: str | None = None) -> int:
    """Answer every prompt of `prompts` (JSONL with prompt_token_ids) with the target, cycling through
    `temperatures` (0 = greedy). Writes {"id", "prompt_token_ids", "output_token_ids", "temperature"}."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.sampling_params import SamplingParams
    from sparkspec.train.data import read_jsonl

    ck = load_checkpoint(model_dir, device=device)
    rows = read_jsonl(prompts)[:limit]
    index, count = shard
    rows = [r for i, r in enumerate(rows) if i % count == index]
    longest = max((len(r["prompt_token_ids"]) for r in rows), default=1)
    max_len = min(longest + max_tokens, ck.config.max_position_embeddings)
    # no tokenizer: answers are token ids, and the engine then skips detokenizing every step
    engine = LLMEngine(ck.model, None, EngineConfig(max_num_seqs=max(1, min(batch_size, len(rows))),
                                                    max_num_batched_tokens=16384, max_model_len=max(max_len, 2),
                                                    max_waiting=1 << 20))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    done = 0
    t0 = time.perf_counter()
    for b in range(0, len(rows), batch_size):
        group = rows[b : b + batch_size]
        params = []
        for j in range(len(group)):
            t = temperatures[(b + j + index) % len(temperatures)]
            params.append(SamplingParams(max_tokens=max_tokens, temperature=t, seed=seed + b + j + 7919 * index))
        seqs = engine.generate([r["prompt_token_ids"] for r in group], params)
        with out.open("a") as f:  # appended per batch: a run cut short keeps what it finished
            for r, s, p in zip(group, seqs, params):
                f.write(json.dumps({"id": r["id"], "prompt_token_ids": r["prompt_token_ids"],
                                    "output_token_ids": s.token_ids, "temperature": p.temperature}) + "\n")
        done += len(group)
        print(f"[shard {index}/{count}] {done}/{len(rows)} answers, {time.perf_counter() - t0:.0f}s", flush=True)
    return done
