"""Shared training plumbing: device/precision, seeds, a step-or-time budget with a warmup+cosine schedule,
tqdm progress, periodic checkpoints and resume, and `TrainLoop`, the one loop the three trainers (target,
DSpark, MTP) run with their own loss functions.

Precision: parameters stay fp32 (the master copy AdamW updates); on an accelerator the forward runs under
bf16 autocast, on CPU everything is fp32 (exact, and CPU bf16 matmuls are slow).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

# the ops a training step spends its launches on (elementwise chains: mHC's Sinkhorn, norms, rotations, attention's
# softmax): fused by torch.compile on accelerators. Not the cache writes (in place) nor the MoE (grouped GEMMs).
COMPILED_OPS = ("mhc_pre", "mhc_post", "hc_head", "rms_norm", "rope", "sparse_attention", "moe_route")


def use_native_ops(compile: bool = False) -> None:
    """Training needs autograd through every op: use the PyTorch references, not inference kernels; `compile`:
    the references of COMPILED_OPS through torch.compile on accelerator tensors."""
    from sparkspec.ops.registry import ops

    ops.set_native(True, compiled=COMPILED_OPS if compile else ())


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:
        pass
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    from sparkspec.platform import current_platform

    return current_platform().device


def autocast(device: torch.device):
    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@dataclass
class Budget:
    """Train until `steps` optimizer steps or `minutes` of wall time, whichever comes first.

    The schedule follows `progress` = the larger of the two fractions, so a time-limited run still
    warms up and decays to zero."""

    steps: int
    minutes: float | None = None
    warmup_frac: float = 0.04
    start_time: float = field(default_factory=time.perf_counter)
    elapsed_before: float = 0.0  # seconds spent in earlier (resumed) runs

    @property
    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.start_time

    def progress(self, step: int) -> float:
        p = step / max(self.steps, 1)
        if self.minutes:
            p = max(p, self.elapsed / (60 * self.minutes))
        return min(p, 1.0)

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0

    def lr_scale(self, step: int) -> float:
        p = self.progress(step)
        if p < self.warmup_frac:
            return max(p / self.warmup_frac, 1e-3)
        q = (p - self.warmup_frac) / max(1 - self.warmup_frac, 1e-9)
        return 0.5 * (1 + math.cos(math.pi * min(q, 1.0)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def progress_bar(total: int, desc: str, disable: bool | None = None):
    from tqdm import tqdm

    if disable is None:
        disable = os.environ.get("SPARKSPEC_NO_PROGRESS") == "1"
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=disable, mininterval=2.0)


STATE_FILE = "train_state.pt"


def save_state(out_dir: Path, step: int, params: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
               elapsed: float, log: list[dict], extra: dict | None = None) -> Path:
    """Resumable state (trainable parameters, optimizer, step, wall time, loss log), written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "params": {k: v.detach().cpu() for k, v in params.items()},
                "opt": opt.state_dict(), "elapsed": elapsed, "log": log, "extra": extra or {},
                "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)
    return path


def load_state(out_dir: Path) -> dict | None:
    path = out_dir / STATE_FILE
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def resume(state_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, log: RunLog) -> tuple[int, float]:
    """Restore parameters, optimizer and loss log from `state_dir` if a saved state is there -> (step, elapsed s)."""
    state = load_state(state_dir)
    if state is None:
        return 0, 0.0
    model.load_state_dict(state["params"])
    opt.load_state_dict(state["opt"])
    log.entries = state["log"]
    print(f"resumed from {state_dir / STATE_FILE} at step {state['step']}")
    return state["step"], state["elapsed"]


def optimizer_step(opt: torch.optim.Optimizer, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Backward, clip the gradient norm at 1, step -> the pre-clip gradient norm."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return gnorm


class Throughput:
    """Tokens per second over the steps after the first few (compilation and warm-up excluded)."""

    def __init__(self, tokens_per_step: int, skip: int = 3):
        self.tokens_per_step, self.skip = tokens_per_step, skip
        self.t0: float | None = None
        self.first = 0
        self.rate = 0.0

    def step(self, step: int) -> None:
        now = time.perf_counter()
        if self.t0 is None or step <= self.skip:
            self.t0, self.first = now, step
        elif step > self.first:
            self.rate = self.tokens_per_step * (step - self.first) / (now - self.t0)


@dataclass
class RunLog:
    """Loss history kept with the checkpoint and summarised in the README (first/last averages, time)."""

    entries: list[dict] = field(default_factory=list)

    def add(self, step: int, elapsed: float, **values: float) -> None:
        self.entries.append({"step": step, "time_s": round(elapsed, 2), **{k: round(float(v), 5)
                                                                            for k, v in values.items()}})

    def summary(self, window: int = 5) -> dict:
        if not self.entries:
            return {}
        window = max(1, min(window, len(self.entries) // 4))
        keys = [k for k in self.entries[-1] if k not in ("step", "time_s")]
        head, tail = self.entries[:window], self.entries[-window:]
        return {"steps": self.entries[-1]["step"], "time_s": self.entries[-1]["time_s"],
                **{f"{k}_first": sum(e.get(k, 0) for e in head) / len(head) for k in keys},
                **{f"{k}_last": sum(e.get(k, 0) for e in tail) / len(tail) for k in keys}}

    def write(self, path: Path, **meta) -> None:
        path.write_text(json.dumps({"summary": self.summary(), **meta, "log": self.entries}, indent=1) + "\n")


def adamw(params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    kw = {"fused": True} if params and params[0].is_cuda else {}
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **kw)


def epoch_batches(num: int, batch_size: int, gen: torch.Generator) -> Iterator[list[int]]:
    """Endless batches of `batch_size` indices into `num` items: a fresh permutation (drawn from `gen`) per
    epoch, its tail short of a full batch skipped (with batch_size > num, every batch is a whole permutation)."""
    order, cursor = torch.randperm(num, generator=gen).tolist(), 0
    while True:
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(num, generator=gen).tolist(), 0
        yield order[cursor : cursor + batch_size]
        cursor += batch_size


LossTerms = Callable[[], dict[str, torch.Tensor]]  # one batch -> named scalar losses, "loss" the one minimised


class TrainLoop:
    """The training loop of every trainer: resume from `state_dir` if a state is saved there, then until the
    budget is spent: set the scheduled LR, run `loss_terms()` (one fresh batch) under autocast, step the
    optimizer on its "loss"; every 10 steps (and at step 1) log the terms, the pre-clip gradient norm, the LR
    and, given `tokens_per_step`, tokens per second; every `save_every` steps save a resumable state."""

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float, steps: int,
                 minutes: float | None, device: torch.device, state_dir: Path, save_every: int,
                 tokens_per_step: int | None = None):
        self.name, self.model, self.opt, self.lr, self.device = name, model, opt, lr, device
        self.state_dir, self.save_every = Path(state_dir), save_every
        self.log = RunLog()
        self.step, elapsed_before = resume(self.state_dir, model, opt, self.log)  # 0, 0.0 on a fresh run
        self.budget = Budget(steps, minutes, elapsed_before=elapsed_before)
        self.timer = Throughput(tokens_per_step) if tokens_per_step else None

    @property
    def tokens_per_s(self) -> float:
        return self.timer.rate if self.timer else 0.0

    def run(self, loss_terms: LossTerms) -> None:
        bar = progress_bar(self.budget.steps, self.name)
        bar.update(self.step)
        while not self.budget.done(self.step):
            set_lr(self.opt, self.lr * self.budget.lr_scale(self.step))
            with autocast(self.device):
                terms = loss_terms()
            grad_norm = optimizer_step(self.opt, self.model, terms["loss"])
            self.step += 1
            if self.timer:
                self.timer.step(self.step)
            if self.step % 10 == 0 or self.step == 1:
                self._record(bar, terms, grad_norm)
            bar.update(1)
            if self.save_every and self.step % self.save_every == 0:
                save_state(self.state_dir, self.step, self.model.state_dict(), self.opt, self.budget.elapsed,
                           self.log.entries)
        bar.close()

    def _record(self, bar, terms: dict[str, torch.Tensor], grad_norm: torch.Tensor) -> None:
        vals = {n: float(v.detach()) for n, v in terms.items()}
        lr = self.opt.param_groups[0]["lr"]
        rate = {"tokens_per_s": self.timer.rate} if self.timer else {}
        self.log.add(self.step, self.budget.elapsed, **vals, grad_norm=float(grad_norm), lr=lr, **rate)
        shown = {"loss": f"{vals['loss']:.3f}"}
        if "accept" in vals:
            shown["acc"] = f"{vals['accept']:.3f}"
        if self.timer:
            shown["tok_s"] = f"{self.timer.rate:.0f}"
        bar.set_postfix(**shown)
        if bar.disable and self.step % 100 == 0:  # no bar (SPARKSPEC_NO_PROGRESS=1, e.g. a job log): a line
            print(f"{self.name} step {self.step} " + " ".join(f"{n} {v:.4f}" for n, v in vals.items())
                  + f" lr {lr:.2e}" + (f" {self.timer.rate:.0f} tok/s" if self.timer else "")
                  + f" {self.budget.elapsed:.0f}s", flush=True)
