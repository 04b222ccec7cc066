"""Tensor parallelism over gloo on CPU: two processes with half the heads, half of every expert and half the
vocabulary each give the single process's logits (1e-5, fp64 weights) and the same greedy tokens, with and
without speculative decoding. A failing rank takes the group down with an error, never a hang."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(model, tensors, method, prompts):
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.sampling_params import SamplingParams

    cfg = EngineConfig(max_num_seqs=4, speculative=method, num_spec_tokens=3 if method != "none" else None,
                       spec_budget="fixed")
    return [o.token_ids for o in LLMEngine(model, None, cfg, tensors).generate(
        prompts, SamplingParams(max_tokens=10, ignore_eos=True))]


def worker(rank: int, world: int, port: int, out: str, fail_rank: int, expert_parallel: bool = False) -> None:
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=60))
    from spec_helpers import mixed_prompts, tiny_setup

    from sparkspec.distributed import ParallelGroup
    from sparkspec.distributed.tensor_parallel import shard_
    from sparkspec.models.forward_batch import forward_sequences

    cfg, model, tensors = tiny_setup()
    ids = torch.tensor(mixed_prompts(cfg.vocab_size, [37], seed=3)[0])
    prompts = mixed_prompts(cfg.vocab_size, [5, 17, 26], seed=4)
    with torch.inference_mode():
        want = forward_sequences(model, ids, [37]).logits
        want_tokens = {m: generate(model, tensors, m, prompts) for m in ("none", "dspark", "mtp")}
    shard_(model, ParallelGroup(rank, world), expert_parallel)
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} failed on purpose")
    with torch.inference_mode():
        got = forward_sequences(model, ids, [37]).logits
        got_tokens = {m: generate(model, tensors, m, prompts) for m in ("none", "dspark", "mtp")}
    torch.save({"diff": (got - want).abs().max().item(), "want": want_tokens, "got": got_tokens,
                "heads": model.layers[0].attn.n_heads, "experts": len(model.layers[1].ffn.experts)},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_two_ranks_equal_one(tmp_path, expert_parallel):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), -1, expert_parallel), nprocs=2)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["heads"] == 2  # half of the tiny preset's 4 heads
        assert r["experts"] == (4 if expert_parallel else 8)  # of 8 routed experts
        assert r["diff"] < 1e-5
        assert r["got"] == r["want"]
        assert r["got"]["none"] == r["got"]["dspark"] == r["got"]["mtp"]


def test_a_failing_rank_is_an_error_not_a_hang(tmp_path):
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        mp.spawn(worker, args=(2, free_port(), str(tmp_path), 1), nprocs=2)


@pytest.mark.parametrize("extra", [["--tensor-parallel-size", "2"],
                                   ["--tensor-parallel-size", "2", "--enable-expert-parallel"]], ids=["tp2", "ep2"])
def test_generate_with_two_processes_equals_one(tiny_checkpoint_with_drafters, extra, capsys):
    """`sparkspec generate --tensor-parallel-size 2`: ranks 1.. in their own processes, the same tokens."""
    import json

    from sparkspec.cli import main

    def run(more):
        args = ["generate", "--model", str(tiny_checkpoint_with_drafters), "--prompt", "hello there",
                "--prompt", "a b c", "--max-tokens", "12", "--spec", "dspark", "--device", "cpu", "--json", *more]
        assert main(args) == 0
        return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]

    assert run(extra) == run([])
