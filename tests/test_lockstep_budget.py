"""Lockstep ranks take the same adaptive-budget decisions although their own step times differ: every rank's
budget reads rank 0's clock from the step's message (`engine/lockstep.py: StepClock`). Two engines in one
process, the broadcast replaced by a recording (rank 0) and a replay (the worker); the worker's steps are made
slower, which, read from its own clock, would change its regime decisions and leave one rank waiting in a
collective the other never enters."""

from __future__ import annotations

import copy
import time

from spec_helpers import mixed_prompts, tiny_setup

import sparkspec.engine.lockstep as lockstep
from sparkspec.distributed import ParallelGroup
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams


def record_decisions(engine) -> list[tuple[int, bool]]:
    """Each step's k and whether it writes the drafter's context (`VerificationBudget.writes_context`: a rank whose
    step skipped it would run another graph)."""
    ks, choose = [], engine.spec.num_drafts_to_propose

    def wrapped(*args, **kwargs):
        k = choose(*args, **kwargs)
        ks.append((k, engine.spec.budget.writes_context))
        return k

    engine.spec.num_drafts_to_propose = wrapped
    return ks


def test_worker_budget_decisions_follow_rank_zero(monkeypatch, tmp_path):
    cfg, model, tensors = tiny_setup()
    ec = EngineConfig(max_num_seqs=4, speculative="dspark", num_spec_tokens=3, spec_budget="adaptive",
                      cost_cache_dir=str(tmp_path))
    prompts = mixed_prompts(cfg.vocab_size, [5, 17, 26, 9], seed=12)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    sent: list = []
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list",
                        lambda box, src=0, group=None: sent.append(copy.deepcopy(box[0])))
    rank0 = lockstep.DistributedLLMEngine(model, None, ec, tensors, pg=ParallelGroup(0, 2))
    ks0 = record_decisions(rank0)
    want = [o.token_ids for o in rank0.generate(prompts, params)]
    rank0.shutdown()
    assert any(("clock", m[1]) == m for msgs in sent[1:] for m in msgs if m[0] == "clock")

    replay = iter(sent)

    def receive(box, src=0, group=None):
        box[0] = next(replay)

    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", receive)
    worker = LLMEngine(model, None, ec, tensors)
    ks1 = record_decisions(worker)
    execute = worker.runner.execute

    def slow(*args, **kwargs):  # the worker's own clock would see steps several times longer than rank 0's
        time.sleep(0.004)
        return execute(*args, **kwargs)

    worker.runner.execute = slow
    lockstep.worker_loop(worker, ParallelGroup(1, 2))
    assert ks1 == ks0 and len(ks0) > 10
    assert worker.stats.num_generation_tokens == rank0.stats.num_generation_tokens == sum(map(len, want))
    assert worker.stats.num_accepted == rank0.stats.num_accepted
