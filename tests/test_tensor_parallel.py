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


# ---------------------------------------------------------------- sharded loading: each rank reads its slices


def full_then_shard(path, pg, expert_parallel, dtype):
    from sparkspec.distributed.tensor_parallel import shard_
    from sparkspec.loading.checkpoint import load_checkpoint

    ck = load_checkpoint(path, device="cpu", dtype=dtype)
    shard_(ck.model, pg, expert_parallel)
    return ck


def assert_sharded_load_equals_full_then_shard(path, expert_parallel, dtype=torch.float32):
    """Every rank's sharded load holds exactly the tensors (names, shapes, values) of a full load then `shard_`;
    returns the ranks' bytes read."""
    from sparkspec.distributed import ParallelGroup
    from sparkspec.loading.checkpoint import load_checkpoint

    read = []
    for rank in range(2):
        pg = ParallelGroup(rank, 2)
        got = load_checkpoint(path, device="cpu", dtype=dtype, parallel=pg, expert_parallel=expert_parallel)
        want = full_then_shard(path, pg, expert_parallel, dtype).model.state_dict()
        have = got.model.state_dict()
        assert have.keys() == want.keys()
        for name, t in want.items():
            assert have[name].dtype == t.dtype and torch.equal(have[name], t), name
        assert sorted(got.drafter_tensors) == sorted(load_checkpoint(path, device="cpu").drafter_tensors)
        read.append(got.load_stats.bytes_read)
    return read


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
def test_sharded_load_reads_only_the_ranks_slices(tiny_checkpoint, tiny_checkpoint_with_drafters, expert_parallel):
    from sparkspec.distributed import ParallelGroup
    from sparkspec.loading.checkpoint import load_checkpoint

    assert_sharded_load_equals_full_then_shard(tiny_checkpoint_with_drafters, expert_parallel)  # drafters whole
    path = tiny_checkpoint
    full = load_checkpoint(path, device="cpu")
    read = assert_sharded_load_equals_full_then_shard(path, expert_parallel)
    for share in read:  # the replicated part (latent, indexer, mHC, router) keeps it a little above half
        assert 0.4 < share / full.load_stats.bytes_read < 0.65
    ck = load_checkpoint(path, device="cpu", parallel=ParallelGroup(1, 2), expert_parallel=expert_parallel)
    cfg, attn, ffn = ck.config, ck.model.layers[0].attn, ck.model.layers[1].ffn
    assert attn.wq_b.weight.shape[0] == full.model.layers[0].attn.wq_b.weight.shape[0] // 2
    assert ck.model.embed.weight.shape[0] == ck.model.head.weight.shape[0] == cfg.vocab_size // 2
    if expert_parallel:
        assert len(ffn.experts) == cfg.n_routed_experts // 2 and ffn.experts_held == (cfg.n_routed_experts // 2,
                                                                                      cfg.n_routed_experts // 2)
    else:
        assert ffn.experts[0].w2.weight.shape[1] == cfg.moe_intermediate_size // 2
    with pytest.raises(ValueError, match="already sharded"):
        from sparkspec.distributed.tensor_parallel import shard_

        shard_(ck.model, ParallelGroup(1, 2))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantised_checkpoint_loads_sharded(tmp_path, expert_parallel, dtype):
    """FP8 128x128 blocks cut inside a block (the tiny dims are smaller than a block) and FP4 1x32 blocks cut
    by columns (`w2`): the covering blocks are read, dequantised and trimmed; scales live in other shards."""
    sys.path.insert(0, TESTS)
    from conftest import tiny_config
    from test_loading import quantised, write_shards

    from sparkspec.loading.random_init import random_target_tensors

    cfg = tiny_config(moe_intermediate_size=32)  # one FP4 block per w2 row: each rank's half is cut from it
    raw, _ = quantised(random_target_tensors(cfg, torch.Generator().manual_seed(8)))
    assert_sharded_load_equals_full_then_shard(write_shards(tmp_path, raw, cfg), expert_parallel, dtype)


def drafter_worker(rank: int, world: int, port: int, out: str) -> None:
    """The DSpark drafter sharded like the target (`shard_drafter_`, whole experts per rank) drafts the same."""
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=60))
    from spec_helpers import mixed_prompts, tiny_setup

    from sparkspec.distributed import ParallelGroup
    from sparkspec.distributed.tensor_parallel import shard_, shard_drafter_
    from sparkspec.engine.config import EngineConfig
    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.loading.drafters import dspark_from_tensors
    from sparkspec.sampling_params import SamplingParams
    from sparkspec.spec_decode.dspark import DSparkProposer

    cfg, model, tensors = tiny_setup()
    drafter = dspark_from_tensors(cfg, tensors).keep_fp32().eval()
    prompts = mixed_prompts(cfg.vocab_size, [5, 17], seed=4)
    config = EngineConfig(max_num_seqs=4, speculative="dspark", num_spec_tokens=3, spec_budget="fixed")

    g = torch.Generator().manual_seed(5)
    taps = torch.randn(6, len(cfg.dspark_target_layer_ids), cfg.hidden_size, generator=g)
    block_ids = torch.randint(4, cfg.vocab_size, (2, cfg.dspark_block_size), generator=g)

    def run():
        eng = LLMEngine(model, None, config, proposer=DSparkProposer(model, drafter, 3))
        outs = eng.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        ctx = drafter.context_kv(drafter.main_x(taps), torch.arange(6))  # one block after 3 rows, one after 6
        block = drafter.forward_block(model.embed, model.head, block_ids, torch.tensor([3, 6]), ctx,
                                      torch.tensor([[-1, 0, 1, 2], [2, 3, 4, 5]]), block_ids)
        return [o.token_ids for o in outs], block.markov_logits

    with torch.inference_mode():
        want = run()
    pg = ParallelGroup(rank, world)
    shard_(model, pg, expert_parallel=True)
    cuts = shard_drafter_(drafter, pg, expert_parallel=True)
    with torch.inference_mode():
        got = run()
    torch.save({"want": want[0], "got": got[0], "diff": (got[1] - want[1]).abs().max().item(), "num_cuts": len(cuts),
                "experts": len(drafter.mtp[0].ffn.experts)},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_sharded_drafter_drafts_the_same(tmp_path):
    mp.spawn(drafter_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["got"] == r["want"] and r["diff"] < 1e-5  # the engine runs; the drafter's logits are the same
        assert r["num_cuts"] > 0 and r["experts"] == 4
