"""`bench.replay`: DSpark's acceptance replayed on plain decoding's sequences. Gumbel-max: the engine's own
verify steps and accepted drafts, request by request (any proposal rule); rejection: the simulated acceptances
follow min(1, q(x) / p(x)) per slot. Deterministic (fixed seeds)."""

from __future__ import annotations

import math

import pytest
import torch

from sparkspec.bench import replay
from sparkspec.ops.sampling import SamplingTensors
from sparkspec.sampling_params import SamplingParams as SP


def one_row(params: SP, seed: int) -> SamplingTensors:
    return SamplingTensors(torch.tensor([params.device_temperature]), torch.tensor([params.top_k]),
                           torch.tensor([params.top_p]), torch.tensor([seed]), params.greedy, params.top_k > 0,
                           params.top_p < 1, True)


def test_chain_follows_the_engine_steps():
    L = torch.tensor([2, 9, 9, 0, 1, 5, 5, 5])
    # steps at anchors 0 (2 accepted), 3 (0), 4 (1), 6 (5, capped at the 3 drafts verified)
    assert replay.chain(L, torch.full_like(L, 3)) == (2 + 0 + 1 + 3, 4)
    assert replay.chain(L, torch.tensor([3, 3, 3, 0, 3, 3, 3, 3])) == (6, 3)  # anchor 3 drafts nothing: no verify


def test_rejection_replay_matches_the_closed_form():
    """E[L] at an anchor is sum_j prod_{i <= j} min(1, q_i(x_i) / p_i(x_i)): the replayed mean is within 5 sigma."""
    A, k, V, reps = 5, 3, 6, 4000
    g = torch.Generator().manual_seed(0)
    b = replay.ReplayBlocks(torch.arange(A) + 10, torch.randint(0, V, (A, k), generator=g),
                            torch.randn(A, k, V, generator=g), torch.randn(A, k, V, generator=g))
    b.labels[-1, 1:] = -1  # the sequence ends inside the last block
    st = one_row(SP(temperature=0.8), 3)
    L = replay.rejection_lengths(b, st, reps, torch.Generator().manual_seed(1)).double()  # [reps, A]
    p = torch.softmax(b.target_logits / 0.8, -1).gather(2, b.labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    q = torch.softmax(b.draft_logits / 0.8, -1).gather(2, b.labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    r = torch.minimum(q / p, torch.ones_like(p)).double() * b.mask
    want = r.cumprod(1).sum(1)  # [A]
    assert torch.all((L.mean(0) - want).abs() < 5 * L.std(0) / math.sqrt(reps) + 1e-9)
    assert (L[:, -1] <= 1).all()


@pytest.fixture(scope="module")
def demo():
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL

    ckpt = load_checkpoint(DEFAULT_MODEL, device="cpu")
    prompts = ["What is 17 times 23?", "def fibonacci(n):", "Tell me a story.", "Hi"]
    ids = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
           for p in prompts]
    return ckpt, ids


@pytest.mark.parametrize("s", [1.0, 0.5])
def test_gumbel_replay_is_the_engine(demo, s):
    """Batch-1 DSpark (fixed k, Gumbel-max, proposal rule s): the replay on the emitted sequence gives each request's
    verify steps and accepted drafts exactly, whether max_tokens or EOS stopped it."""
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.spec_decode.build import build_proposer

    ckpt, ids = demo
    proposer = build_proposer("dspark", ckpt.model, ckpt.drafter_tensors, None, s)
    config = EngineConfig(speculative="dspark", spec_budget="fixed", max_num_seqs=1, max_model_len=256,
                          sampling_scheme="gumbel")
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, config, ckpt.drafter_tensors, proposer=proposer)
    reasons, total = set(), 0
    for i, prompt in enumerate(ids):
        params = SP(temperature=1.0 if i % 2 == 0 else 0.7, top_p=1.0 if i < 2 else 0.9, seed=30 + i,
                    max_tokens=40, ignore_eos=i < 2)
        before_steps, before_acc = engine.stats.spec.num_steps, engine.stats.num_accepted
        (out,) = engine.generate([prompt], params)
        b = replay.dspark_blocks(ckpt.model, proposer.drafter, prompt + out.token_ids, len(prompt))
        room = replay.engine_room(b, proposer.num_spec_tokens, out.finish_reason == "length")
        got = replay.chain(replay.gumbel_lengths(b, one_row(params, 30 + i), s), room)
        assert got == (engine.stats.num_accepted - before_acc, engine.stats.spec.num_steps - before_steps), i
        reasons.add(out.finish_reason)
        total += got[0]
    assert total > 0 and reasons == {"length", "stop"}  # both ends of a sequence were replayed


def test_eval_paired_reports_both_schemes(tmp_path, capsys):
    """`sparkspec eval --paired`: a rejection row and one Gumbel row per draft temperature, per dataset and T."""
    import json

    from sparkspec.cli import main

    out = tmp_path / "paired.json"
    assert main(["eval", "--paired", "--datasets", "gsm8k", "--num-prompts", "2", "--max-tokens", "16",
                 "--temperature", "1", "--gumbel-draft-temperature", "1,0.5", "--paired-reps", "20",
                 "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["scheme"], r["gumbel_draft_temperature"]) for r in rows] == [("rejection", 1.0), ("gumbel", 1.0),
                                                                            ("gumbel", 0.5)]
    assert all(r["estimator"] == "paired" and r["steps"] > 0 and 1 <= r["tau"] <= 8 for r in rows)
    assert "tau(gumbel) / tau(rejection)" in capsys.readouterr().out
