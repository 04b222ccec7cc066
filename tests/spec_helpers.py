"""Tiny deterministic helpers for the speculative-decoding tests (random target + drafters, built in-test)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from sparkspec.config import ModelConfig
from sparkspec.loading.random_init import init_dspark_tensors, init_mtp_tensors, random_tensors
from sparkspec.loading.state import load_state
from sparkspec.models.deepseek_v4 import DeepseekV4Model

DEVICE = torch.device("cpu")


def tiny_config(**overrides) -> ModelConfig:
    cfg = ModelConfig.preset("tiny")
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def random_target(cfg: ModelConfig, seed: int = 0, head_scale: float = 4.0,
                  dtype: torch.dtype = torch.float64) -> DeepseekV4Model:
    """A random target; `head_scale` spreads the logits so that greedy ties never decide a test."""
    model = DeepseekV4Model(cfg)
    tensors = random_tensors(model, torch.Generator().manual_seed(seed))
    tensors["head.weight"] *= head_scale
    load_state(model, tensors)
    return model.to(DEVICE, dtype).eval()


def drafter_tensors(cfg: ModelConfig, seed: int = 1, which: str = "both") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    if which in ("dspark", "both"):
        out.update(init_dspark_tensors(cfg, g))
    if which in ("mtp", "both"):
        out.update(init_mtp_tensors(cfg, g, cfg.num_dspark_layers if which == "both" else 0))
    return out


@functools.cache
def tiny_setup(seed: int = 0):
    cfg = tiny_config()
    return cfg, random_target(cfg, seed), drafter_tensors(cfg, seed + 1)


def static_step_engine(model, tensors, method: str, static: bool, max_num_seqs: int, async_scheduling: bool = False,
                       **kw):
    """An eager engine (fixed budget, k = 3 where it drafts); `static`: its steps packed and padded as CUDA graphs
    are, run eagerly (`use_graphs(eager=True)`: the layout a GPU replays, checked on CPU)."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine

    cfg = EngineConfig(max_num_seqs=max_num_seqs, speculative=method, num_spec_tokens=3 if method != "none" else None,
                       spec_budget="fixed", enforce_eager=True, async_scheduling=async_scheduling, **kw)
    eng = LLMEngine(model, None, cfg, tensors)
    if static:
        k = eng.spec.num_spec_tokens if eng.spec else 0
        eng.runner.use_graphs(cfg.max_num_seqs, eng.max_model_len, k, eager=True,
                              max_num_batched_tokens=cfg.max_num_batched_tokens)
    return eng


def run_recording_drafts(eng, prompts: list[list[int]], params: list, late: dict[int, int] | None = None
                         ) -> tuple[list[list[int]], dict, dict]:
    """Add `prompts` (request ids "0", "1", ...; `params` one per prompt) and step `eng` until every request ends ->
    (output ids per prompt, {(request, pending position): the drafts it held there}, {request: its block ids as
    last seen running}). `late`: {prompt index: steps run before it is added} (the others join at once)."""
    late = late or {}
    pending = {i: (str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    made, outputs, blocks = {}, {}, {}
    num_steps = 0
    while pending or eng.has_unfinished():
        for i in [i for i in pending if late.get(i, 0) <= num_steps]:
            rid, p, sp = pending.pop(i)
            eng.add_request(p, sp, request_id=rid)
        num_steps += 1
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        for seq in eng.scheduler.running:
            blocks[seq.request_id] = list(seq.block_ids)
            if seq.spec.draft_ids:
                made[(seq.request_id, seq.num_tokens)] = list(seq.spec.draft_ids)
    return [outputs[str(i)] for i in range(len(prompts))], made, blocks


def mixed_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids >= 4 keep clear of bos / eos / the noise token; repeats make n-gram lookup fire now and then
    out = []
    for n in lengths:
        base = torch.randint(4, vocab, (max(1, n // 2),), generator=g).tolist()
        out.append((base * 3)[:n] if n % 3 == 0 else torch.randint(4, vocab, (n,), generator=g).tolist())
    return out


@pytest.fixture(autouse=False)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads collapse on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
