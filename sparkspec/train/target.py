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
    from sparkspec.checkpoint import random_target_tensors
    from sparkspec.models.weights import load_state

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


def forward_lm(model: DeepseekV4Model, ids: torch.Tensor, **kw):
    """ids [B, L] -> ModelOutput over B fresh sequences (logits for every row: [B·L, V])."""
    B, L = ids.shape
    return forward_sequences(model, ids.reshape(-1), [L] * B, **kw)


def lm_loss(model: DeepseekV4Model, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over windows [B, L+1]."""
    inputs, labels = windows[:, :-1], windows[:, 1:]
    out = forward_lm(model, inputs)
    return F.cross_entropy(out.logits.float(), labels.reshape(-1))


def sample_windows(stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def train_target(cfg: ModelConfig, data: Path, out_dir: Path, tokenizer_dir: Path | None, steps: int,
                 minutes: float | None, batch_size: int, seq_len: int, lr: float, seed: int = 0,
                 device: str | None = None, save_every: int = 500, shard_mb: int = 14,
                 heldout_frac: float = 0.01) -> dict:
    """Train, checkpoint every `save_every` steps (resumable from `out_dir/train_state.pt`), write the final
    checkpoint (bf16, official layout, shards <= shard_mb) and `train_log.json`. Returns the log summary."""
    from sparkspec.checkpoint import write_checkpoint

    common.use_native_ops()
    dev = common.pick_device(device)
    common.seed_everything(seed)
    stream = np.load(data, mmap_mode="r")
    if stream.max(initial=0) >= cfg.vocab_size:
        raise ValueError(f"{data}: token id {int(stream.max())} >= vocab_size={cfg.vocab_size}")
    split = int(len(stream) * (1 - heldout_frac))
    train_stream, val_stream = np.asarray(stream[:split]), np.asarray(stream[split:])
    cfg.torch_dtype = "float32"
    model = init_target(cfg, seed).to(dev)
    model.train()
    opt = common.adamw(model.parameters(), lr, weight_decay=0.1)
    log = common.RunLog()
    step, elapsed_before = common.resume(out_dir, model, opt, log)
    rng = np.random.default_rng(seed + step)
    budget = common.Budget(steps, minutes, elapsed_before=elapsed_before)
    bar = common.progress_bar(steps, "target")
    bar.update(step)
    tokens_per_step = batch_size * seq_len
    while not budget.done(step):
        common.set_lr(opt, lr * budget.lr_scale(step))
        windows = sample_windows(train_stream, batch_size, seq_len, rng).to(dev)
        with common.autocast(dev):
            loss = lm_loss(model, windows)
        gnorm = common.optimizer_step(opt, model, loss)
        step += 1
        if step % 10 == 0 or step == 1:
            log.add(step, budget.elapsed, loss=loss.item(), grad_norm=gnorm.item(), lr=opt.param_groups[0]["lr"])
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step * step / budget.elapsed:.0f}")
            if bar.disable and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} "
                      f"{budget.elapsed:.0f}s", flush=True)
        bar.update(1)
        if save_every and step % save_every == 0:
            common.save_state(out_dir, step, model.state_dict(), opt, budget.elapsed, log.entries)
    bar.close()
    model.eval()
    val = evaluate_lm(model, val_stream, batch_size, seq_len, dev)
    write_checkpoint(model, cfg, out_dir, tokenizer_dir=tokenizer_dir, shard_size_bytes=shard_mb << 20,
                     dtype="bfloat16")
    (out_dir / common.STATE_FILE).unlink(missing_ok=True)
    meta = {"steps": step, "time_s": round(budget.elapsed, 1), "batch_size": batch_size, "seq_len": seq_len,
            "tokens_seen": step * tokens_per_step, "lr": lr, "val_loss": val, "data": str(data),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3)}
    log.write(out_dir / "train_log_target.json", **meta)
    return {**log.summary(), **meta}


@torch.no_grad()
def evaluate_lm(model: DeepseekV4Model, stream: np.ndarray, batch_size: int, seq_len: int,
                dev: torch.device, max_batches: int = 4) -> float:
    rng = np.random.default_rng(1234)
    losses = []
    for _ in range(max_batches):
        if len(stream) <= seq_len + 1:
            break
        with common.autocast(dev):
            losses.append(lm_loss(model, sample_windows(stream, batch_size, seq_len, rng).to(dev)).item())
    return round(sum(losses) / max(len(losses), 1), 4)


# ---------------------------------------------------------------- answer regeneration


def regenerate(model_dir: Path, prompts: Path, out: Path, max_tokens: int, temperatures: list[float],
               batch_size: int, shard: tuple[int, int] = (0, 1), limit: int | None = None, seed: int = 0,
               device: str | None = None) -> int:
    """Answer every prompt of `prompts` (JSONL with prompt_token_ids) with the target, cycling through
    `temperatures` (0 = greedy). Writes {"id", "prompt_token_ids", "output_token_ids", "temperature"}."""
    from sparkspec.checkpoint import load_checkpoint
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
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
        for j, r in enumerate(group):
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
