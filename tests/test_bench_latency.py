"""`sparkspec bench latency` runs end to end on CPU (tiny configs): rows, JSON, the speculative split, and the
transformers comparison on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from sparkspec.bench.hf_compare import transformers_pair
from sparkspec.bench.latency import step_bytes
from sparkspec.cli import main
from sparkspec.config import ModelConfig
from sparkspec.models.forward_batch import forward_sequences
from sparkspec.spec_decode.proposer import HostProposer


def run(args, tmp_path) -> list[dict]:
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--dtype", "float32", "--input-len", "12", "--output-len", "6",
                 "--json", str(out), *args]) == 0
    return json.loads(out.read_text())["results"]


def test_plain_rows(tmp_path):
    rows = run(["--preset", "tiny", "--batch-sizes", "1,3"], tmp_path)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["ms_per_step"] > 0 and r["tok_s"] > 0 and r["x_floor"] > 0 for r in rows)


def test_speculative_rows_split_draft_and_verify(tiny_checkpoint_with_drafters, tmp_path):
    rows = run(["--model", str(tiny_checkpoint_with_drafters), "--batch-sizes", "2", "--spec", "dspark",
                "--num-spec-tokens", "3"], tmp_path)
    r = rows[0]
    assert r["verify_ms"] > 0
    # the two parts add up to the step they split (each of the three is rounded to 1e-3 ms)
    assert r["verify_ms"] + r["draft_ms"] == pytest.approx(r["split_step_ms"], abs=1.6e-3)


class GreedyReplay(HostProposer):
    """Drafts the target's own greedy continuation (every draft accepted), or the same with its first token
    changed (every step rejects its first draft)."""

    method = "greedy-replay"

    def __init__(self, model, k: int, wrong_first: bool):
        super().__init__(k)
        self.model, self.wrong_first = model, wrong_first

    @torch.no_grad()
    def propose_ids(self, token_ids, k):
        out = []
        for ids in token_ids:
            ids, new = list(ids), []
            for _ in range(k):
                new.append(int(forward_sequences(self.model, torch.tensor(ids), [len(ids)]).logits[-1].argmax()))
                ids.append(new[-1])
            if self.wrong_first:
                new[0] = (new[0] + 1) % self.model.cfg.vocab_size
            out.append(new)
        return out


@pytest.mark.parametrize("wrong_first,tau", [(False, 4.0), (True, 1.0)], ids=["all_accepted", "none_accepted"])
def test_tau_counts_accepted_drafts(tiny_checkpoint, wrong_first, tau):
    """Greedy, k = 3: a drafter that is always right gives τ = 1 + k, one that is always wrong at its first draft
    τ = 1. 17 tokens: the prefill's 1 and two untimed steps' 4 + 4 leave 8, two full timed steps (no step is cut
    short by max_tokens)."""
    from sparkspec.bench.latency import engine_step_ms
    from sparkspec.loading.checkpoint import load_checkpoint

    model = load_checkpoint(tiny_checkpoint, device="cpu", dtype="float32").model
    out = {}
    engine_step_ms(model, 2, 12, 17, "none", 3, out=out, proposer=GreedyReplay(model, 3, wrong_first))
    assert out["tau"] == tau


def test_transformers_pair_shares_weights():
    pytest.importorskip("transformers")
    cfg = ModelConfig.preset("tiny")
    hf, ours = transformers_pair(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(2, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(forward_sequences(ours, ids, [24]).logits, hf(ids.unsqueeze(0)).logits[0],
                                   rtol=0, atol=1e-5)


def test_floor_counts_more_experts_and_kv_for_bigger_batches():
    from sparkspec.models.deepseek_v4 import DeepseekV4Model

    with torch.device("meta"):
        model = DeepseekV4Model(ModelConfig.preset("bench-1b"))
    assert step_bytes(model, 1, 512) < step_bytes(model, 8, 512) < step_bytes(model, 64, 512)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert step_bytes(model, 1, 512) < 0.5 * total  # one token reads 4 of 32 experts per layer, not all of them


def test_two_ranks_expert_parallel_report_per_rank(tmp_path):
    """--tensor-parallel-size 2 --enable-expert-parallel on gloo: one row per rank and batch size, the
    imbalance over experts and ranks; with --uniform-routing every expert gets the same tokens."""
    rows = run(["--preset", "tiny", "--random-weights", "--tensor-parallel-size", "2", "--enable-expert-parallel",
                "--batch-sizes", "4", "--uniform-routing", "--output-len", "5"], tmp_path)
    assert [(r["batch"], r["rank"]) for r in rows] == [(4, 0), (4, 1)]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["floor_ms"] > 0 and r["active_GB"] > 0 and r["bandwidth_GBs"] > 0
        assert r["expert_max_mean"] == 1.0 and r["rank_max_mean"] == 1.0  # 4 tokens x 2 slots = 8 experts
    meta = json.loads((tmp_path / "lat.json").read_text())["meta"]
    assert meta["tensor_parallel_size"] == 2 and meta["expert_parallel"] and meta["weights"] == "random float32"


def test_random_routing_is_uneven_and_random_drafter_runs(tmp_path):
    rows = run(["--preset", "tiny", "--batch-sizes", "4", "--spec", "dspark", "--num-spec-tokens", "2",
                "--output-len", "8"], tmp_path)
    assert rows[0]["expert_max_mean"] > 1.0 and "tau" in rows[0]  # τ is reported only after verify steps


def test_uniform_routing_reads_distinct_experts():
    from sparkspec.models.deepseek_v4 import DeepseekV4Model

    with torch.device("meta"):
        model = DeepseekV4Model(ModelConfig.preset("bench-1b"))
    # 4 tokens x 4 slots: 16 distinct experts of 32 when uniform, fewer when random (collisions)
    assert step_bytes(model, 4, 512, uniform=True) > step_bytes(model, 4, 512)
    assert step_bytes(model, 1, 512, rows_per_request=8) > step_bytes(model, 1, 512)  # verify rows hit more


def test_truncated_config_keeps_layer_shapes():
    from sparkspec.bench.latency import truncated

    cfg = ModelConfig.preset("deepseek-v4-flash")
    small = truncated(cfg, 6)
    assert small.num_hidden_layers == 6 and small.layer_types == cfg.layer_types[:6]
    assert small.dspark_target_layer_ids == [3, 4, 5] and small.hidden_size == cfg.hidden_size
    with pytest.raises(ValueError, match="--num-layers 44"):
        truncated(cfg, 44)


def test_random_weights_in_the_quantized_layout_give_finite_logits():
    """--quantization keep on random weights: FP8 attention / shared-expert layers and FP4 routed experts (the
    layouts a kept checkpoint loads into), values as sane as the plain init's, in fewer bytes."""
    from sparkspec.loading.quantized import Fp4Linear, Fp8Linear
    from sparkspec.loading.random_model import random_model

    cfg = ModelConfig.preset("tiny")
    cpu = torch.device("cpu")
    kept, _ = random_model(cfg, cpu, torch.bfloat16, quantization="keep")
    plain, _ = random_model(cfg, cpu, torch.bfloat16, quantization="dequantize")
    layer = kept.layers[0]
    assert isinstance(layer.attn.wq_a, Fp8Linear) and isinstance(layer.ffn.shared_experts.w2, Fp8Linear)
    assert all(isinstance(e.w1, Fp4Linear) for e in layer.ffn.experts)
    assert isinstance(kept.head, torch.nn.Linear) and kept.head.weight.dtype == torch.bfloat16

    def nbytes(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())

    assert nbytes(kept) < 0.7 * nbytes(plain)
    assert step_bytes(kept, 1, 64) < step_bytes(plain, 1, 64)
    ids = torch.randint(2, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = forward_sequences(kept, ids, [24]).logits.float()
        reference = forward_sequences(plain, ids, [24]).logits.float()
    assert logits.isfinite().all()
    assert 0.5 < logits.std() / reference.std() < 2  # the dequantised weights have the plain init's std


@pytest.mark.parametrize("ranks", [[], ["--tensor-parallel-size", "2", "--enable-expert-parallel"]],
                         ids=["world1", "tp2_ep"])
def test_bench_builds_random_weights_quantized(tmp_path, ranks):
    """`bench latency --quantization keep` with random weights times steps on the FP8 / FP4 layout and counts its
    bytes (fewer active bytes than the same run in bf16); "auto" stays in bf16 on the CPU, as the loader does."""
    common = ["--preset", "tiny", "--random-weights", "--batch-sizes", "2", "--output-len", "4", *ranks,
              "--dtype", "bfloat16"]
    rows = run([*common, "--quantization", "keep"], tmp_path)
    meta = json.loads((tmp_path / "lat.json").read_text())["meta"]
    assert meta["weights"] == "random fp8/fp4 + bfloat16"
    plain = run(common, tmp_path)
    assert json.loads((tmp_path / "lat.json").read_text())["meta"]["weights"] == "random bfloat16"
    assert len(rows) == len(plain) == (2 if ranks else 1)
    for q, p in zip(rows, plain):
        assert q["ms_per_step"] > 0 and 0 < q["active_MB_per_token"] < p["active_MB_per_token"]


def test_rows_count_preemptions_inside_the_timed_steps(monkeypatch):
    """A row whose timed steps recomputed a preempted prompt says so (it is then not a pure decode time): with
    two thirds of the KV blocks that 3 requests need, the count is > 0; with all of them it is 0."""
    import dataclasses

    import sparkspec.engine.llm_engine as llm_engine
    from sparkspec.bench.latency import engine_step_ms
    from sparkspec.loading.random_model import random_model

    model, _ = random_model(ModelConfig.preset("tiny"), torch.device("cpu"), torch.float32)
    out = {}
    engine_step_ms(model, 3, 12, 24, out=out)
    assert out["preemptions"] == 0 and out["kv_blocks"] > 0
    real = llm_engine.plan_kv_cache

    def two_thirds(*args, **kw):
        plan = real(*args, **kw)
        return dataclasses.replace(plan, num_blocks=plan.num_blocks * 2 // 3)

    monkeypatch.setattr(llm_engine, "plan_kv_cache", two_thirds)
    out = {}
    engine_step_ms(model, 3, 12, 24, out=out)
    assert out["preemptions"] > 0


def test_batch_invariant_cost_times_both_modes_on_one_model(tmp_path, capsys, monkeypatch):
    """--batch-invariant-cost: every row also holds the invariant engine's step and its ratio to the default one,
    the invariant engine is built with the mode on (and only it), and the mode is off again afterwards."""
    import sparkspec.bench.latency as latency
    from sparkspec.ops.batch_invariant import batch_invariant_enabled

    seen = []
    real = latency.engine_step_ms

    def spy(*args, **kw):
        seen.append(batch_invariant_enabled())
        return real(*args, **kw)

    monkeypatch.setattr(latency, "engine_step_ms", spy)
    rows = run(["--preset", "tiny", "--batch-sizes", "1,2", "--batch-invariant-cost"], tmp_path)
    assert seen == [False, True, False, True] and not batch_invariant_enabled()
    for r in rows:
        assert r["invariant_ms_per_step"] > 0 and r["invariant_preemptions"] == 0
        assert r["invariant_cost"] == pytest.approx(r["invariant_ms_per_step"] / r["ms_per_step"] - 1, abs=2e-3)
    capsys.readouterr()
    assert main(["bench", "latency", "--preset", "tiny", "--batch-invariant-cost", "--batch-invariant"]) == 2
    assert "--batch-invariant-cost" in capsys.readouterr().err
