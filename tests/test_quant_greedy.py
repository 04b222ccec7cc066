"""`loading.quantized.dequantize_layers_` and `bench.quant_greedy`: the quantised layers become plain linears
holding their exact dequantised weights, and the comparison's bookkeeping (first difference, top-2 gap)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkspec.bench.quant_greedy import compare, first_difference, run, top2_gap
from sparkspec.config import ModelConfig
from sparkspec.loading.quantized import Fp4Linear, Fp8Linear, dequantize_layers_
from sparkspec.loading.random_model import random_model
from sparkspec.ops.formats import dequant_fp4, dequant_fp8_block


def test_dequantize_layers_keeps_the_values():
    """Every Fp8Linear / Fp4Linear becomes an nn.Linear whose weight is its dequantised value, and the model's
    output stays what the quantised layers computed (fp32, CPU: the natives dequantise, then multiply)."""
    model, _ = random_model(ModelConfig.preset("tiny"), torch.device("cpu"), torch.float32, quantization="keep")
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp4Linear))}
    assert Fp8Linear in kinds.values() and Fp4Linear in kinds.values()
    want = {}
    for name in kinds:
        q = model.get_submodule(name)
        want[name] = (dequant_fp8_block if kinds[name] is Fp8Linear else dequant_fp4)(q.weight, q.scale)
    x = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = next(n for n in kinds if ".experts." not in n and n.endswith("wq_a"))
    before = model.get_submodule(layer)(x)
    assert sorted(dequantize_layers_(model, torch.float32)) == sorted(kinds)
    for name, w in want.items():
        m = model.get_submodule(name)
        assert type(m) is nn.Linear and m.bias is None and torch.equal(m.weight, w)
    torch.testing.assert_close(model.get_submodule(layer)(x), before, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, (Fp8Linear, Fp4Linear)) for m in model.modules())


def test_quantised_and_dequantised_greedy_agree_in_fp32():
    """Through the engine on the tiny preset in fp32 on the CPU the two paths compute the same products: every
    prompt's tokens are equal (a wrong scale or layout in the dequantisation would part them)."""
    quantized, reference, logprobs, alone = run("tiny", 2, "cpu", "float32", 3, 16, 6, log=lambda *_: None,
                                                noise_floor=True)
    assert quantized == reference and all(len(t) == 6 for t in quantized)
    assert alone == reference  # fp32 on the CPU: one prompt at a time gives the batch's tokens
    rows = compare(quantized, reference, logprobs, 1e-2)
    assert all(r["equal"] for r in rows)
    assert all(len(lp) == 6 and all(len(d) >= 2 for d in lp) for lp in logprobs)


def test_comparison_bookkeeping():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert top2_gap({7: -0.1, 9: -0.105, 4: -3.0}) == (pytest.approx(0.005), 9)
    assert top2_gap({7: 0.0}) == (float("inf"), None)
    lps = [[{1: -0.1, 2: -2.0}, {2: -0.5, 5: -0.504}], [{3: -0.01, 4: -5.0}, {4: -0.2, 6: -1.8}]]
    rows = compare([[1, 5], [3, 6]], [[1, 2], [3, 4]], lps, 1e-2)
    assert rows[0] == {"prompt": 0, "equal": False, "first_difference": 1, "top2_gap": pytest.approx(0.004),
                       "took_second": True, "near_tie": True}
    assert rows[1]["first_difference"] == 1 and rows[1]["took_second"] and not rows[1]["near_tie"]
    assert compare([[1, 2]], [[1, 2]], [lps[0]], 1e-2) == [{"prompt": 0, "equal": True}]


def test_fp8_activation_switch_is_scoped_and_read_by_the_fp8_path(monkeypatch):
    """`fp8_activations` sets SPARKSPEC_FP8_ACTIVATIONS only inside (restoring an earlier value or its absence),
    and the cuBLAS FP8 path's gate reads it: off keeps every step on the kernels that leave x unquantised."""
    import os

    from sparkspec.bench.quant_greedy import fp8_activations
    from sparkspec.ops import quant

    monkeypatch.delenv("SPARKSPEC_FP8_ACTIVATIONS", raising=False)
    with fp8_activations(False):
        assert os.environ["SPARKSPEC_FP8_ACTIVATIONS"] == "0"
    assert "SPARKSPEC_FP8_ACTIVATIONS" not in os.environ
    monkeypatch.setenv("SPARKSPEC_FP8_ACTIVATIONS", "1")
    with fp8_activations(False):
        assert os.environ["SPARKSPEC_FP8_ACTIVATIONS"] == "0"
    assert os.environ["SPARKSPEC_FP8_ACTIVATIONS"] == "1"

    # the gate, on a stand-in for a large CUDA step (everything else about the device made to pass)
    class FakeCuda:
        type, index = "cuda", 0

    class X:
        device = FakeCuda()

        def numel(self):
            return quant.SCALED_MM_MIN_ROWS * 128

    w = torch.empty(128, 128)
    monkeypatch.setattr(quant.torch.version, "cuda", "13.0")
    monkeypatch.setattr(quant, "_PROBED", {0: True})
    monkeypatch.setattr(quant.torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(quant.F, "scaled_mm", object(), raising=False)
    monkeypatch.setattr(quant.F, "ScalingType", type("S", (), {"BlockWise128x128": 1}), raising=False)
    with fp8_activations(True):
        assert quant.scaled_mm_usable(X(), w)
    with fp8_activations(False):
        assert not quant.scaled_mm_usable(X(), w)
