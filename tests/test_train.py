"""Training tools on CPU: each step lowers its loss on a tiny synthetic problem, the DSpark loss equals a
hand computation, drafters survive a checkpoint round trip, STS fixes a mis-calibrated head, eval reports."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparkspec.config import ModelConfig
from sparkspec.train import common
from sparkspec.train.calibrate import ece, fit_sts, prefix_survival
from sparkspec.train.dspark import block_forward, dspark_loss, init_drafter, position_weights, sample_blocks
from sparkspec.train.features import Sequences, compute_features, freeze
from sparkspec.train.mtp import init_mtp, mtp_loss
from sparkspec.train.target import init_target, pack_windows

DEVICE = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    c = ModelConfig.preset("tiny")
    c.torch_dtype = "float32"
    return c


def synthetic_sequences(num: int, length: int, prompt: int, vocab: int, seed: int = 0) -> Sequences:
    """Sequences whose answers follow a fixed cycle (learnable), prompts random."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for s in range(num):
        head = torch.randint(6, vocab, (prompt,), generator=g)
        cycle = torch.arange(length - prompt) % 5 + 10 + s % 3
        ids.append(torch.cat([head, cycle]))
    cu = torch.arange(num + 1) * length
    return Sequences(torch.cat(ids), cu, torch.full((num,), prompt), torch.zeros(num))


def steps_lower_loss(loss_fn, params, num_steps: int = 6, lr: float = 3e-3) -> tuple[float, float]:
    opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=lr)
    first = None
    for _ in range(num_steps):
        loss = loss_fn()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    return first, loss_fn().item()


def test_dspark_loss_terms_match_hand_computation():
    draft = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # [N=1, k=2, V=3]
    target = torch.tensor([[[1.0, 1.0, 0.0], [0.0, 2.0, 0.0]]])
    conf = torch.tensor([[0.3, -1.2]])
    labels = torch.tensor([[0, 1]])
    mask = torch.tensor([[True, True]])
    terms = dspark_loss(draft, conf, target, labels, mask)

    def softmax(v):
        e = [math.exp(x) for x in v]
        return [x / sum(e) for x in e]

    w = [1.0, math.exp(-1 / 4)]
    ce = l1 = bce = 0.0
    for i in range(2):
        pd, pt = softmax(draft[0, i].tolist()), softmax(target[0, i].tolist())
        d = sum(abs(a - b) for a, b in zip(pd, pt))
        c = min(max(1 - d / 2, 0), 1)
        s = 1 / (1 + math.exp(-conf[0, i].item()))
        ce += w[i] * -math.log(pd[labels[0, i]])
        l1 += w[i] * d
        bce += w[i] * -(c * math.log(s) + (1 - c) * math.log(1 - s))
    ce, l1, bce = ce / sum(w), l1 / sum(w), bce / sum(w)
    assert terms["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert terms["l1"].item() == pytest.approx(l1, rel=1e-5)
    assert terms["conf"].item() == pytest.approx(bce, rel=1e-5)
    assert terms["loss"].item() == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * bce, rel=1e-5)
    assert position_weights(3).tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])


def test_dspark_loss_masks_unsupervised_slots():
    draft, target = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    labels = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    a = dspark_loss(draft, None, target, labels, mask)
    draft2 = draft.clone()
    draft2[0, 2] += 7.0  # a masked slot must not matter
    b = dspark_loss(draft2, None, target, labels, mask)
    assert a["loss"].item() == pytest.approx(b["loss"].item())


def test_target_step_lowers_loss(cfg):
    common.use_native_ops()
    torch.manual_seed(0)
    model = init_target(cfg, seed=0)
    stream = torch.randint(0, cfg.vocab_size, (66,)).numpy()
    batch = pack_windows(stream, [0, 33], 32, None)  # two windows of 33 tokens, one sequence each
    first, last = steps_lower_loss(lambda: batch.loss(model), model.parameters())
    assert last < first


@pytest.fixture(scope="module")
def frozen_target(cfg):
    common.use_native_ops()
    return freeze(init_target(cfg, seed=1))


def test_dspark_step_lowers_loss(cfg, frozen_target):
    seqs = synthetic_sequences(3, 40, 8, cfg.vocab_size)
    feats = compute_features(frozen_target, seqs, tuple(cfg.dspark_target_layer_ids))
    drafter = init_drafter(cfg, seed=0)
    bb = sample_blocks(seqs, [0, 1, 2], cfg.dspark_block_size, 6, cfg.dspark_noise_token_id,
                       torch.Generator().manual_seed(0))
    assert bb.block_ids.shape == (18, cfg.dspark_block_size)
    assert (bb.block_ids[:, 1:] == cfg.dspark_noise_token_id).all()
    assert (bb.prev_ids[:, 0] == bb.block_ids[:, 0]).all()  # teacher forcing starts at the anchor
    assert (bb.prev_ids[:, 1:][bb.mask[:, :-1]] == bb.labels[:, :-1][bb.mask[:, :-1]]).all()

    def loss():
        out, t_logits = block_forward(drafter, frozen_target, feats, bb, DEVICE)
        return dspark_loss(out.markov_logits, out.confidence_logits, t_logits, bb.labels, bb.mask)["loss"]

    first, last = steps_lower_loss(loss, drafter.parameters())
    assert last < first


def test_mtp_step_lowers_loss(cfg, frozen_target):
    seqs = synthetic_sequences(2, 30, 6, cfg.vocab_size)
    feats = compute_features(frozen_target, seqs, (), with_streams=True)
    model = init_mtp(cfg, seed=0)
    first, last = steps_lower_loss(lambda: mtp_loss(model, frozen_target, feats, seqs, [0, 1], DEVICE)["loss"],
                                   model.parameters())
    assert last < first


def test_drafters_round_trip_through_checkpoint(cfg, tmp_path):
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.loading.drafters import dspark_from_tensors, mtp_from_tensors
    from sparkspec.loading.random_init import init_checkpoint
    from sparkspec.train.features import save_drafter

    init_checkpoint("tiny", tmp_path, seed=0)
    ck = load_checkpoint(tmp_path, device="cpu", dtype="float32")
    dspark, mtp = init_drafter(ck.config, seed=3), init_mtp(ck.config, seed=4)
    save_drafter(tmp_path, tmp_path, ck, dspark.state_dict(), ["mtp.0.", "mtp.1."])
    ck = load_checkpoint(tmp_path, device="cpu", dtype="float32")
    save_drafter(tmp_path, tmp_path, ck, mtp.state_dict(), ["mtp.2."])
    ck = load_checkpoint(tmp_path, device="cpu", dtype="float32")
    d2 = dspark_from_tensors(ck.config, ck.drafter_tensors)
    m2 = mtp_from_tensors(ck.config, ck.drafter_tensors)
    for a, b in ((dspark, d2), (mtp, m2)):
        for (name, p), (name2, q) in zip(a.state_dict().items(), b.state_dict().items()):
            assert name == name2
            assert torch.equal(p, q), name


def test_sts_fixes_an_overconfident_head():
    g = torch.Generator().manual_seed(0)
    n, k = 4000, 4
    z_true = torch.randn(n, k, generator=g) * 1.5 + 1.0
    step = torch.bernoulli(torch.sigmoid(z_true), generator=g)
    y = step.cumprod(1)
    valid = torch.ones(n, k, dtype=torch.bool)
    z_raw = 3.0 * z_true  # deliberately over-confident logits
    ones = torch.ones(k)
    temps = fit_sts(z_raw, y, valid)
    before = [ece(prefix_survival(z_raw, ones)[:, j], y[:, j]) for j in range(k)]
    after = [ece(prefix_survival(z_raw, temps)[:, j], y[:, j]) for j in range(k)]
    assert all(a < b for a, b in zip(after, before))
    assert max(after) <= 0.03
    assert temps[0].item() == pytest.approx(3.0, rel=0.25)


def test_eval_on_tiny_checkpoint_reports(tmp_path, capsys):
    from sparkspec.cli import main
    from sparkspec.loading.random_init import init_checkpoint

    init_checkpoint("tiny", tmp_path / "ck", seed=0, drafter="both")
    data = tmp_path / "data"
    data.mkdir()
    (data / "toy.jsonl").write_text("\n".join(json.dumps({"turns": [t, "second turn"]})
                                             for t in ("What is 2+2?", "Write a haiku.")) + "\n")
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tmp_path / "ck"), "--spec", "dspark,mtp", "--datasets", "toy",
               "--data-dir", str(data), "--num-prompts", "2", "--max-tokens", "12", "--temperature", "0,1",
               "--baseline", "--device", "cpu", "--json", str(out), "--plot", str(tmp_path / "acc.png")])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["method"], r["temperature"]) for r in rows} == {(m, t) for m in ("none", "dspark", "mtp")
                                                               for t in (0.0, 1.0)}
    for r in rows:
        if r["method"] == "dspark":
            assert len(r["cond_accept"]) == len(r["accept_rate"]) == 4 and r["steps"] > 0
            # τ (from the accepted total) = 1 + Σ accept_rate@i (from the per-position counts); 5 values rounded
            assert r["tau"] == pytest.approx(1 + sum(r["accept_rate"]), abs=3e-4)
    assert (tmp_path / "acc.png").stat().st_size > 0
    assert "tau" in capsys.readouterr().out


def test_resume_restores_parameters_optimizer_step_and_log(tmp_path):
    from sparkspec.train import common

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = common.adamw(model.parameters(), 1e-2)
    common.optimizer_step(opt, model, model(torch.randn(5, 4)).square().mean())
    common.save_state(tmp_path, 7, model.state_dict(), opt, 12.5, [{"step": 7, "loss": 1.0}])
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = common.adamw(fresh.parameters(), 1e-2)
    log = common.RunLog()
    assert common.resume(tmp_path, fresh, fresh_opt, log) == (7, 12.5)
    assert log.entries == [{"step": 7, "loss": 1.0}]
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert common.resume(tmp_path / "none", fresh, fresh_opt, common.RunLog()) == (0, 0.0)


def test_train_loop_logs_saves_and_resumes(tmp_path):
    """The one loop of the three trainers: logs at step 1 and every 10, saves every `save_every`, and a second
    run resumes at the saved step, calling the loss only for the steps left."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loop_and_calls(model):
        loop = common.TrainLoop("t", model, common.adamw(model.parameters(), 1e-2), 1e-2, steps=12, minutes=None,
                                device=DEVICE, state_dir=tmp_path, save_every=5)
        calls = []

        def loss_terms():
            calls.append(loop.step)
            return {"loss": (model(x) - y).square().mean()}

        return loop, loss_terms, calls

    loop, loss_terms, calls = loop_and_calls(torch.nn.Linear(4, 1))
    loop.run(loss_terms)
    assert loop.step == 12 and calls == list(range(12))
    assert [e["step"] for e in loop.log.entries] == [1, 10]
    assert {"loss", "grad_norm", "lr"} <= loop.log.entries[-1].keys()
    assert loop.log.entries[-1]["loss"] < loop.log.entries[0]["loss"]
    assert common.load_state(tmp_path)["step"] == 10
    again, loss_terms, calls = loop_and_calls(torch.nn.Linear(4, 1))
    assert again.step == 10 and again.log.entries == loop.log.entries
    again.run(loss_terms)
    assert calls == [10, 11] and again.step == 12


def test_epoch_batches_cover_every_item_once_per_epoch():
    batches = common.epoch_batches(7, 2, torch.Generator().manual_seed(0))
    first = [next(batches) for _ in range(3)]  # 6 of 7 items; the seventh is the tail skipped
    assert all(len(b) == 2 for b in first) and len({i for b in first for i in b}) == 6
    assert set(next(batches)) <= set(range(7))  # a new permutation
    assert sorted(next(common.epoch_batches(3, 5, torch.Generator().manual_seed(0)))) == [0, 1, 2]


def test_survival_map_calibrates_correlated_blocks_at_every_position():
    """Blocks that either lock onto the target (everything accepted) or drift (each draft a coin flip): the
    acceptances are correlated, so per-position temperatures cannot calibrate the later positions; the survival
    maps, fitted on one half, do on the other."""
    from sparkspec.models.dspark import survival_confidences
    from sparkspec.train.calibrate import ece_survival_map, fit_survival_map

    g = torch.Generator().manual_seed(3)
    n, k = 16000, 5
    locked = torch.rand(n, generator=g) < torch.sigmoid(torch.randn(n, generator=g) * 2)
    z = torch.randn(n, k, generator=g) + 2.0 * locked.float().unsqueeze(1)  # the logits see the state, noisily
    steps = torch.where(locked.unsqueeze(1), torch.ones(n, k), torch.bernoulli(torch.full((n, k), 0.5), generator=g))
    y = steps.cumprod(1)
    valid = torch.ones(n, k, dtype=torch.bool)
    fit, test = slice(0, n // 2), slice(n // 2, n)
    table = fit_survival_map(z[fit], y[fit], valid[fit])
    after = ece_survival_map(z[test], y[test], valid[test], table)
    sts = fit_sts(z[fit], y[fit], valid[fit])
    sts_ece = [ece(prefix_survival(z[test], sts)[:, j], y[test][:, j]) for j in range(k)]
    assert max(after) <= 0.03
    assert max(after) < max(sts_ece)
    conf = survival_confidences(z[test], table)
    assert ((conf >= 0) & (conf <= 1)).all()


def test_survival_map_confidences_multiply_into_the_mapped_survivals():
    from sparkspec.models.dspark import block_feature, survival_confidences

    z = torch.tensor([[1.5, -0.3, 0.8], [-2.0, 0.1, 3.0]])
    # survival of position i: f^(i + 1), sampled at 201 knots (non-increasing in i)
    grid = torch.linspace(0, 1, 201)
    table = torch.stack([grid ** (i + 1) for i in range(3)])
    f = block_feature(z).unsqueeze(-1)
    conf = survival_confidences(z, table)
    torch.testing.assert_close(conf.cumprod(-1), f ** torch.arange(1, 4), atol=2e-3, rtol=0)
    torch.testing.assert_close(survival_confidences(z, torch.ones(3, 9)), torch.ones(2, 3))
