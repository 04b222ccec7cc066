"""The streaming loader (`load_checkpoint`: meta model, one tensor at a time) against the way checkpoints were
loaded before it: the whole state dict in memory, `load_state` into a model built on the device. Same parameters,
same buffers, same logits, for `sparkspec init` checkpoints, transformers' `save_pretrained` and FP8 / FP4 shards
(scales in other shards than their weights); and a bounded peak host memory."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from conftest import DEVICE, random_ids, run_full, tiny_config
from helpers import quantize_fp4, quantize_fp8_block
from safetensors.torch import save_file
from test_weights import write_raw

from sparkspec.loading import CheckpointError, stream
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.loading.names import official_name, split_fused_experts
from sparkspec.loading.plan import plan_tensors
from sparkspec.loading.random_init import random_target_tensors
from sparkspec.loading.save import write_checkpoint
from sparkspec.loading.state import load_state
from sparkspec.loading.stream import read_tensors
from sparkspec.models.deepseek_v4 import DeepseekV4Model, Rotary
from sparkspec.ops.formats import dequant_fp4, dequant_fp8_block

DTYPES = [torch.float32, torch.bfloat16]


def old_way(cfg, tensors, dtype=torch.float32, device=DEVICE) -> DeepseekV4Model:
    """What load_checkpoint did before streaming: build on the device, cast, keep_fp32, copy every tensor."""
    with torch.device(device):
        model = DeepseekV4Model(cfg)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.keep_fp32()
    load_state(model, {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    return model.eval()


def assert_same_model(got: DeepseekV4Model, want: DeepseekV4Model) -> None:
    """Every parameter and buffer equal in value, dtype, device and requires_grad; the RoPE master copies too."""
    g_sd, w_sd = dict(got.named_parameters()), dict(want.named_parameters())
    assert sorted(g_sd) == sorted(w_sd)
    for name, p in w_sd.items():
        q = g_sd[name]
        assert (q.dtype, q.device, q.requires_grad) == (p.dtype, p.device, p.requires_grad), name
        assert torch.equal(q, p), name
    g_b, w_b = dict(got.named_buffers()), dict(want.named_buffers())
    assert sorted(g_b) == sorted(w_b)
    for name, b in w_b.items():
        assert g_b[name].dtype == b.dtype and g_b[name].device == b.device and torch.equal(g_b[name], b), name
    rot_g = [m for m in got.modules() if isinstance(m, Rotary)]
    rot_w = [m for m in want.modules() if isinstance(m, Rotary)]
    for a, b in zip(rot_g, rot_w, strict=True):
        assert torch.equal(a.inv_freq_fp32, b.inv_freq_fp32) and a.inv_freq_fp32.device == b.inv_freq_fp32.device
        assert a.freq_key == b.freq_key
    assert not got.training


def assert_same_logits(got: DeepseekV4Model, want: DeepseekV4Model, n: int = 40) -> None:
    ids = random_ids(n, got.cfg.vocab_size, seed=5)
    with torch.no_grad():
        a, b = run_full(got, ids).logits, run_full(want, ids).logits
    assert float(b.float().std()) > 0.1 and torch.equal(a, b)


# ---------------------------------------------------------------- same model as before


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_init_checkpoint_loads_as_before(tiny_checkpoint, dtype):
    ck = load_checkpoint(tiny_checkpoint, device=DEVICE, dtype=dtype)
    want = old_way(ck.config, random_target_tensors(ck.config, torch.Generator().manual_seed(0)), dtype)
    assert_same_model(ck.model, want)
    assert_same_logits(ck.model, want)


def test_bf16_load_keeps_fp32_parameters_and_buffers(tiny_checkpoint):
    """The dtypes of a `.to(bf16).keep_fp32()` model (what test_model checks), and fp32 RoPE, without ever having
    built the model in fp32."""
    ck = load_checkpoint(tiny_checkpoint, device=DEVICE, dtype="bfloat16")
    ref = DeepseekV4Model(ck.config).to(torch.bfloat16).keep_fp32()
    got = dict(ck.model.named_parameters())
    for name, p in ref.named_parameters():
        assert got[name].dtype == p.dtype, name
    assert got["layers.0.hc_attn_fn"].dtype == torch.float32 and got["norm.weight"].dtype == torch.float32
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    buffers = dict(ck.model.named_buffers())
    assert buffers["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    rotaries = [m for m in ck.model.modules() if isinstance(m, Rotary)]
    assert rotaries and all(m.inv_freq.dtype == torch.float32 and m.inv_freq_fp32.dtype == torch.float32
                            for m in rotaries)
    assert not any(t.is_meta for t in [*ck.model.parameters(), *ck.model.buffers()])


def hf_pair(tmp_path, max_shard_size=None):
    """A transformers model saved with save_pretrained (fused experts, transformers names) -> (dir, its tensors
    under official names, split the way the old loader did)."""
    transformers = pytest.importorskip("transformers")
    from test_transformers_parity import CONFIGS, randomise

    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIGS["all-kinds"])).eval()
    randomise(hf, seed=11)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(tmp_path, **kw)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        name = official_name(name)
        if not split_fused_experts(name, t, tensors):
            tensors[name] = t
    return tmp_path, tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_transformers_checkpoint_loads_as_before(tmp_path, dtype):
    path, tensors = hf_pair(tmp_path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    ck = load_checkpoint(path, device=DEVICE, dtype=dtype)
    want = old_way(ck.config, tensors, dtype)
    assert_same_model(ck.model, want)
    assert_same_logits(ck.model, want)


# ---------------------------------------------------------------- FP8 / FP4


def write_shards(path, tensors, cfg, num_files=3):
    """Tensors dealt round-robin over `num_files` shards (sorted names: a weight and its scale end up in
    different files), with an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    groups: list[dict] = [{} for _ in range(num_files)]
    for i, name in enumerate(sorted(tensors)):
        groups[i % num_files][name] = tensors[name].contiguous()
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        save_file(group, str(path / fname))
        weight_map.update(dict.fromkeys(group, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def quantised(sd):
    """FP4 routed experts, FP8 other linears (official `.scale` names) -> (stored tensors, dequantised values)."""
    raw, want = {}, {}
    for name, t in sd.items():
        base = name[: -len("weight")]
        if ".experts." in name and ".shared_experts." not in name:
            q, s = quantize_fp4(t)
            raw[name], raw[base + "scale"] = q.view(torch.int8), s
            want[name] = dequant_fp4(q, s)
        elif name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "head" not in name:
            q, s = quantize_fp8_block(t)
            raw[name], raw[base + "scale"] = q, s.to(torch.float8_e8m0fnu)
            want[name] = dequant_fp8_block(q, s)
        else:
            raw[name] = want[name] = t
    return raw, want


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_quantised_shards_load_like_dequantise_then_load(tmp_path, dtype):
    cfg = tiny_config(moe_intermediate_size=32)  # FP4 scale blocks are 1x32
    sd = random_target_tensors(cfg, torch.Generator().manual_seed(8))
    sd["mtp.0.e_proj.weight"] = torch.randn(32, 32)  # a quantised drafter tensor and a plain one
    sd["mtp.0.hc_head_base"] = torch.randn(2)
    raw, want = quantised(sd)
    assert raw["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    ck = load_checkpoint(write_shards(tmp_path, raw, cfg), device=DEVICE, dtype=dtype)
    ref = old_way(cfg, want, dtype)
    assert_same_model(ck.model, ref)
    assert_same_logits(ck.model, ref)
    assert sorted(ck.drafter_tensors) == ["mtp.0.e_proj.weight", "mtp.0.hc_head_base"]
    e_proj = ck.drafter_tensors["mtp.0.e_proj.weight"]  # dequantised to the load dtype, on the CPU
    assert e_proj.dtype == dtype and e_proj.device.type == "cpu"
    assert torch.equal(e_proj, want["mtp.0.e_proj.weight"].to(dtype))
    assert torch.equal(ck.drafter_tensors["mtp.0.hc_head_base"], sd["mtp.0.hc_head_base"])  # plain: as stored


def test_bytes_read_counts_each_stored_byte_once(tmp_path):
    """FP8 / FP4 weights at their stored size, each scale once although it lives in another shard."""
    cfg = tiny_config(moe_intermediate_size=32)
    raw, _ = quantised(random_target_tensors(cfg, torch.Generator().manual_seed(9)))
    path = write_shards(tmp_path, raw, cfg)
    stored = sum(t.numel() * t.element_size() for t in raw.values())
    ck = load_checkpoint(path, device=DEVICE)
    assert ck.load_stats.bytes_read == stored


# ---------------------------------------------------------------- checks, progress, stats


def test_header_errors_come_before_any_tensor_is_read(tmp_path, monkeypatch):
    sd = random_target_tensors(tiny_config(), torch.Generator().manual_seed(1))
    sd["head.weight"] = torch.zeros(96, 33)
    path = write_raw(tmp_path / "ck", sd)

    def no_reading(*args, **kw):
        raise AssertionError("tensor data read before the checks")

    monkeypatch.setattr(stream, "_read", no_reading)
    with pytest.raises(CheckpointError, match=re.escape("tensor 'head.weight' has shape (96, 33), expected (96, 32)")):
        load_checkpoint(path, device=DEVICE)


def test_progress_bar_and_load_stats(tiny_checkpoint, capfd):
    ck = load_checkpoint(tiny_checkpoint, device=DEVICE, progress=True)
    err = capfd.readouterr().err
    assert "loading weights" in err and "100%" in err
    stats = ck.load_stats
    stored = sum(t.numel() * t.element_size() for t in read_tensors(tiny_checkpoint).values())
    assert stats.bytes_read == stored and stats.seconds > 0 and stats.peak_rss_increase >= 0
    assert stats.peak_rss_source == ("VmHWM" if sys.platform == "linux" else "ru_maxrss")
    load_checkpoint(tiny_checkpoint, device=DEVICE)
    assert "loading weights" not in capfd.readouterr().err


def test_reopening_shards_per_tensor_loads_the_same(tmp_path, monkeypatch):
    """With a tiny REMAP_BYTES every tensor gets a handle of its own (fused w1 / w3 read their row twice)."""
    path, _ = hf_pair(tmp_path)
    want = load_checkpoint(path, device=DEVICE)
    plan = plan_tensors(path)
    monkeypatch.setattr(stream, "REMAP_BYTES", 1)
    assert len(stream._mapping_groups(list(plan), plan)) == len(plan)
    assert_same_model(load_checkpoint(path, device=DEVICE).model, want.model)


def test_tied_embeddings_without_a_head_tensor(tmp_path):
    cfg = tiny_config(tie_word_embeddings=True)
    sd = random_target_tensors(cfg, torch.Generator().manual_seed(2))
    sd.pop("head.weight")
    ck = load_checkpoint(write_raw(tmp_path / "ck", sd, cfg), device=DEVICE)
    assert torch.equal(ck.model.head.weight, ck.model.embed.weight)
    assert ck.model.head.weight is not ck.model.embed.weight


# ---------------------------------------------------------------- peak host memory


def big_config():
    """~80 M parameters (~160 MB in bf16), mostly experts, so that many mid-sized tensors fill the shards."""
    return tiny_config(vocab_size=16384, hidden_size=512, moe_intermediate_size=2048)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


PEAK_SCRIPT = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_loading import model_bytes, old_way
from sparkspec.loading.checkpoint import _reset_peak_rss, _rss_bytes, load_checkpoint, read_config
from safetensors.torch import load_file
path, way = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
if way == "streaming":
    ck = load_checkpoint(path, device="cpu", dtype="bfloat16")
    print(json.dumps([ck.load_stats.peak_rss_increase, ck.load_stats.peak_rss_source, model_bytes(ck.model)]))
else:
    rss0, source = _rss_bytes("VmRSS"), _reset_peak_rss()
    tensors = {{k: t for f in sorted(path.glob("model-*.safetensors")) for k, t in load_file(f).items()}}
    model = old_way(read_config(path), tensors, torch.bfloat16, "cpu")
    print(json.dumps([_rss_bytes("VmHWM") - rss0, source, model_bytes(model)]))
"""


def peak_rss(path, way: str) -> tuple[int, str, int]:
    """(peak RSS increase, how measured, model bytes) of one load in a fresh process: in this one, memory that
    earlier tests freed but the allocator kept would absorb part of the load and hide it."""
    import subprocess
    from pathlib import Path

    script = PEAK_SCRIPT.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script, str(path), way], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(sys.platform != "linux", reason="measures VmHWM in /proc/self/status")
def test_peak_host_memory_is_the_model_plus_about_one_shard(tmp_path):
    """Bound: the loaded model + 1.5x the largest shard. The old way (every shard's tensors read, mapped, then the
    model built in fp32 on the host, cast, and copied into) peaks at the fp32 model or the bf16 model plus the
    checkpoint's pages, both far above it."""
    cfg = big_config()
    write_checkpoint(random_target_tensors(cfg, torch.Generator().manual_seed(3)), cfg, tmp_path,
                     shard_size_bytes=24 << 20, dtype="bfloat16")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    largest = max(f.stat().st_size for f in shards)
    assert len(shards) >= 6
    new, source, size = peak_rss(tmp_path, "streaming")
    old, old_source, old_size = peak_rss(tmp_path, "old")
    assert source == old_source == "VmHWM" and size == old_size
    bound = size + 1.5 * largest
    mb = 1 << 20
    report = (f"model {size / mb:.0f} MB, largest shard {largest / mb:.0f} MB, bound {bound / mb:.0f} MB; "
              f"peak RSS increase: streaming {new / mb:.0f} MB, old way {old / mb:.0f} MB")
    print(report)
    assert size <= new < bound < old, report
