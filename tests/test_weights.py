"""Checkpoint loading and writing: official and transformers names, shards, FP8 / FP4 dequantisation, errors
that name the file / tensor / field, random checkpoints and their tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import DEVICE, make_model, random_ids, run_full, tiny_config
from helpers import quantize_fp4, quantize_fp8_block
from safetensors.torch import save_file

from sparkspec.loading import CheckpointError
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.loading.random_init import init_checkpoint, random_target_tensors
from sparkspec.loading.save import write_checkpoint
from sparkspec.loading.stream import read_tensors
from sparkspec.tokenizer import Tokenizer


def state(seed=0, cfg=None):
    return random_target_tensors(cfg or tiny_config(), torch.Generator().manual_seed(seed))


def write_raw(path, tensors, cfg=None, files=None):
    """A checkpoint dir written without any validation (to test what the loader rejects)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps((cfg or tiny_config()).to_dict()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def assert_same_params(model, tensors):
    for name, p in model.state_dict().items():
        assert torch.equal(p.cpu(), tensors[name].to(p.dtype)), name


# ---------------------------------------------------------------- round trips


def test_official_names_round_trip(tmp_path):
    cfg, sd = tiny_config(), state(1)
    extra = {"mtp.0.main_proj.weight": torch.randn(32, 64), "mtp.1.norm.weight": torch.ones(32)}
    write_checkpoint(sd, cfg, tmp_path, extra_tensors=extra)
    ck = load_checkpoint(tmp_path, device=DEVICE, dtype="float32")
    assert ck.config == cfg and ck.tokenizer is None and not ck.model.training
    assert_same_params(ck.model, sd)
    assert sorted(ck.drafter_tensors) == sorted(extra)
    assert all(torch.equal(ck.drafter_tensors[k], v) for k, v in extra.items())
    ids = random_ids(20, cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(run_full(ck.model, ids).logits, run_full(make_model(cfg, seed=1), ids).logits)


def test_write_from_a_model_with_bf16_storage(tmp_path):
    model = make_model(seed=2)
    write_checkpoint(model, model.cfg, tmp_path, dtype="bfloat16")
    raw = read_tensors(tmp_path)
    assert raw["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert raw["layers.0.hc_attn_fn"].dtype == torch.float32  # mHC, sinks, ape, router bias stay fp32
    assert raw["layers.1.attn.attn_sink"].dtype == torch.float32
    assert raw["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ck = load_checkpoint(tmp_path, device=DEVICE, dtype=torch.bfloat16)
    assert ck.model.layers[0].hc_attn_fn.dtype == torch.float32
    assert torch.equal(ck.model.layers[0].hc_attn_fn.cpu(), model.layers[0].hc_attn_fn.cpu())


def test_sharded_checkpoint_with_index(tmp_path):
    sd = state(3)
    write_checkpoint(sd, tiny_config(), tmp_path, shard_size_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(sd)
    assert {tmp_path / f for f in index["weight_map"].values()} == set(shards)
    assert_same_params(load_checkpoint(tmp_path, device=DEVICE).model, sd)
    write_checkpoint(sd, tiny_config(), tmp_path)  # rewriting unsharded removes the stale shards
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]


TO_TRANSFORMERS = [  # official -> the module names of transformers' DeepseekV4ForCausalLM
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.attn_sink$", ".self_attn.sinks"),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.", ".self_attn."),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.ape$", ".position_bias"),
    (r"(compressor(\.indexer)?)\.norm\.", r"\1.kv_norm."),
    (r"\.ffn\.", ".mlp."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


def to_transformers_names(sd, cfg):
    out = {}
    for name, t in sd.items():
        if ".experts." in name and ".shared_experts." not in name:
            continue
        for pat, rep in TO_TRANSFORMERS:
            name = re.sub(pat, rep, name)
        out[name] = t
    for i in range(cfg.num_hidden_layers):  # fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        e = [f"layers.{i}.ffn.experts.{j}" for j in range(cfg.n_routed_experts)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{x}.w1.weight"], sd[f"{x}.w3.weight"]]) for x in e])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([sd[f"{x}.w2.weight"] for x in e])
    return out


def test_transformers_names_load(tmp_path):
    cfg, sd = tiny_config(), state(4)
    hf = to_transformers_names(sd, cfg)
    assert not any(k.startswith("layers.") or ".attn." in k for k in hf)
    write_raw(tmp_path, hf, cfg)
    assert_same_params(load_checkpoint(tmp_path, device=DEVICE).model, sd)


# ---------------------------------------------------------------- FP8 / FP4


def e4m3_representable(shape, seed):
    """Values that float8_e4m3fn stores exactly."""
    choices = torch.tensor([0.0, 0.5, -1.0, 1.75, -3.0, 448.0, -0.015625, 10.0])
    return choices[torch.randint(0, 8, shape, generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("scale_form", ["scale_e8m0", "weight_scale_inv_fp32"])
def test_fp8_block_dequant_by_hand(tmp_path, scale_form):
    out_f, in_f = 130, 260  # 2 x 3 blocks of 128 x 128, the last ones ragged
    w = e4m3_representable((out_f, in_f), seed=0)
    block_scale = [[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]]
    scale = torch.tensor(block_scale)
    tensors = {"w.weight": w.to(torch.float8_e4m3fn)}
    if scale_form == "scale_e8m0":
        tensors["w.scale"] = scale.to(torch.float8_e8m0fnu)
    else:
        tensors["w.weight_scale_inv"] = scale
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = read_tensors(tmp_path)["w.weight"]
    assert list(read_tensors(tmp_path)) == ["w.weight"]  # the scale is consumed
    for i in (0, 127, 128, 129):
        for j in (0, 127, 128, 255, 256, 259):
            assert float(got[i, j]) == float(w[i, j]) * block_scale[i // 128][j // 128], (i, j)


def e2m1_value(code: int) -> float:
    """FP4 e2m1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man * 0.5))


def test_fp4_dequant_by_hand(tmp_path):
    out_f, in_f = 3, 64  # two 1x32 scale blocks per row
    codes = [[(7 * i + 3 * j + i * j) % 16 for j in range(in_f)] for i in range(out_f)]
    packed = torch.tensor([[codes[i][2 * b] | (codes[i][2 * b + 1] << 4) for b in range(in_f // 2)]
                           for i in range(out_f)], dtype=torch.uint8)  # low nibble = first element
    exps = [[127, 128], [125, 130], [126, 127]]  # ue8m0 bytes: 2^(byte - 127)
    save_file({"e.weight": packed.view(torch.int8), "e.scale": torch.tensor(exps, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))
    got = read_tensors(tmp_path)["e.weight"]
    assert got.shape == (out_f, in_f)
    for i in range(out_f):
        for j in range(in_f):
            assert float(got[i, j]) == e2m1_value(codes[i][j]) * 2.0 ** (exps[i][j // 32] - 127), (i, j)
    assert e2m1_value(0b0111) == 6.0 and e2m1_value(0b1001) == -0.5  # the table's ends


def test_quantized_model_loads_dequantised(tmp_path):
    """FP8 block-scaled linears and FP4 experts in a whole checkpoint; the model sees the dequantised values."""
    cfg = tiny_config(moe_intermediate_size=32)  # FP4 scale blocks are 1x32
    sd = state(5, cfg)
    raw, want = {}, dict(sd)
    for name, t in sd.items():
        if ".experts." in name and ".shared_experts." not in name:
            q, s = quantize_fp4(t)
            raw[name], raw[name[:-len("weight")] + "scale"] = q.view(torch.int8), s
        elif name.endswith(".weight") and t.dim() == 2 and "embed" not in name and "head" not in name:
            q, s = quantize_fp8_block(t)
            raw[name], raw[name[:-len("weight")] + "scale"] = q, s.to(torch.float8_e8m0fnu)
        else:
            raw[name] = t
            continue
        want[name] = read_tensors(write_raw(tmp_path / name, {name: raw[name], name[:-6] + "scale":
                                                              raw[name[:-6] + "scale"]}, cfg))[name]
    assert not torch.equal(want["layers.0.ffn.experts.0.w1.weight"], sd["layers.0.ffn.experts.0.w1.weight"])
    ck = load_checkpoint(write_raw(tmp_path / "ck", raw, cfg), device=DEVICE)
    assert_same_params(ck.model, want)
    ids = random_ids(16, cfg.vocab_size)
    with torch.no_grad():  # quantisation error only: close to the fp32 model, not equal
        diff = run_full(ck.model, ids).logits - run_full(make_model(cfg, seed=5), ids).logits
    assert 0 < float(diff.abs().max()) < 2.0


# ---------------------------------------------------------------- errors name what is wrong


def _broken(tmp_path, edit):
    sd = state(6)
    edit(sd)
    return write_raw(tmp_path / "ck", sd)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("layers.1.attn.compressor.ape"), "missing tensor 'layers.1.attn.compressor.ape'"),
    (lambda sd: sd.__setitem__("layers.0.attn.bogus.weight", torch.zeros(2)),
     "unexpected tensor 'layers.0.attn.bogus.weight'"),
    (lambda sd: sd.__setitem__("head.weight", torch.zeros(96, 33)),
     "tensor 'head.weight' has shape (96, 33), expected (96, 32)"),
    (lambda sd: sd.__setitem__("norm.weight", torch.zeros(32, dtype=torch.int16)),
     "tensor 'norm.weight': unsupported dtype torch.int16"),
    (lambda sd: sd.__setitem__("layers.1.attn.wq_a.weight", torch.zeros(16, 32).to(torch.float8_e4m3fn)),
     "tensor 'layers.1.attn.wq_a.weight': FP8 weight without a '.scale'"),
    (lambda sd: sd.update({"layers.1.attn.wq_a.weight": torch.zeros(16, 32).to(torch.float8_e4m3fn),
                           "layers.1.attn.wq_a.scale": torch.ones(2, 2)}),
     "tensor 'layers.1.attn.wq_a.weight': FP8 block scale has shape (2, 2), expected (1, 1)"),
    (lambda sd: sd["layers.0.ffn.gate.tid2eid"].__setitem__((5, 1), 4),
     "tensor 'layers.0.ffn.gate.tid2eid' holds expert ids in [0, 4], expected [0, 4)"),
])
def test_bad_tensor_errors_name_the_tensor(tmp_path, edit, message):
    path = _broken(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_checkpoint(path, device=DEVICE)
    assert "\n" not in str(info.value)


def test_directory_errors_name_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "empty" / "config.json")) + ": missing"):
        load_checkpoint(tmp_path / "empty")
    path = write_raw(tmp_path / "ck", state(0))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_checkpoint(path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=re.escape(str(path / "model.safetensors")) + ": cannot read"):
        load_checkpoint(path)


def test_bad_config_field_names_file_and_field(tmp_path):
    path = write_raw(tmp_path / "ck", state(0))
    d = json.loads((path / "config.json").read_text())
    d["vocab_size"] = 0
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"config\.json: config field 'vocab_size' = 0"):
        load_checkpoint(path)


def test_index_naming_a_missing_shard(tmp_path):
    write_checkpoint(state(0), tiny_config(), tmp_path, shard_size_bytes=40_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=re.escape(victim.name) + ".*missing"):
        load_checkpoint(tmp_path)


def test_write_checkpoint_validates_the_state_dict(tmp_path):
    sd = state(0)
    sd.pop("norm.weight")
    with pytest.raises(CheckpointError, match="missing tensor 'norm.weight'"):
        write_checkpoint(sd, tiny_config(), tmp_path)
    with pytest.raises(CheckpointError, match="already in the state dict"):
        write_checkpoint(state(0), tiny_config(), tmp_path, extra_tensors={"head.weight": torch.zeros(1)})


def test_unknown_dtype_argument(tiny_checkpoint):
    with pytest.raises(ValueError, match="dtype = 'int4'"):
        load_checkpoint(tiny_checkpoint, dtype="int4")


# ---------------------------------------------------------------- random checkpoints and tokenizer


def test_init_checkpoint_layout_and_determinism(tmp_path, tiny_checkpoint):
    files = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert "compress_ratios" in cfg and cfg["num_hash_layers"] == 1  # the official form
    again = init_checkpoint("tiny", tmp_path / "again", seed=0)
    other = init_checkpoint("tiny", tmp_path / "other", seed=1)
    a, b, c = read_tensors(tiny_checkpoint), read_tensors(again), read_tensors(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert (tiny_checkpoint / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    tid = a["layers.0.ffn.gate.tid2eid"]  # distinct experts per token
    assert all(len(set(row)) == tid.shape[1] for row in tid.tolist())
    assert float(a["layers.1.attn.attn_sink"].abs().min()) > 0


def test_loaded_tiny_checkpoint_has_a_working_tokenizer(tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint, device=DEVICE)
    tok = ck.tokenizer
    assert isinstance(tok, Tokenizer) and tok.vocab_size == ck.config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.token_to_id("<|noise|>") == ck.config.dspark_noise_token_id == 3
    text = "Return the list of lines, naïve café — ok?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode(text, add_special_tokens=True) == [0] + ids
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello"},
                                      {"role": "user", "content": "Bye"}])
    assert prompt == ("<|begin_of_sentence|>Be brief.<|User|>Hi<|Assistant|>Hello<|end_of_sentence|>"
                      "<|User|>Bye<|Assistant|>")
    ids = tok.encode(prompt)
    assert ids[0] == 0 and ids.count(4) == 2 and ids[-1] == 5 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "Be brief.HiHelloBye"
    with pytest.raises(ValueError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_write_checkpoint_copies_the_tokenizer(tmp_path, tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint, device=DEVICE)
    write_checkpoint(ck.model, ck.config, tmp_path, tokenizer_dir=tiny_checkpoint)
    again = load_checkpoint(tmp_path, device=DEVICE)
    assert again.tokenizer is not None and again.tokenizer.chat_template == ck.tokenizer.chat_template
    assert again.tokenizer.encode("hello world") == ck.tokenizer.encode("hello world")


def test_tokenizer_errors_name_the_file(tmp_path, tiny_checkpoint):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tokenizer.json")) + ": tokenizer file not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_checkpoint / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end_of_sentence|>"}}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == 1 and tok.bos_token_id is None
    with pytest.raises(ValueError, match="has no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_tiny_checkpoint_generates_varied_tokens(tiny_checkpoint):
    from sparkspec.engine.llm import LLM
    from sparkspec.sampling_params import SamplingParams

    llm = LLM(tiny_checkpoint, device=DEVICE, max_num_seqs=1, max_model_len=128)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 and len(set(out.token_ids)) > 10


def test_init_checkpoint_sharded_and_bf16(tmp_path):
    path = init_checkpoint("tiny", tmp_path, seed=3, shard_size_bytes=200_000, dtype="bfloat16")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    ck = load_checkpoint(path, device=DEVICE, dtype="float32")
    assert ck.config.torch_dtype == "bfloat16" and ck.model.embed.weight.dtype == torch.float32


def test_init_checkpoint_refuses_a_drafter_the_config_lacks(tmp_path):
    with pytest.raises(ValueError, match="dspark_block_size"):
        init_checkpoint(tiny_config(dspark_block_size=None, dspark_target_layer_ids=None), tmp_path, drafter="dspark")
    with pytest.raises(ValueError, match="drafter = 'eagle'"):
        init_checkpoint("tiny", tmp_path, drafter="eagle")


def test_init_checkpoint_with_drafters(tiny_checkpoint_with_drafters):
    ck = load_checkpoint(tiny_checkpoint_with_drafters, device=DEVICE)
    assert ck.drafter_tensors and all(k.startswith("mtp.") for k in ck.drafter_tensors)
