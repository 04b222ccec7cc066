"""Checkpoint directories in the HF / official DeepSeek layout: load, write, and create random ones.

A directory holds `config.json` (official form), `model.safetensors` or shards + `model.safetensors.index.json`,
optionally `tokenizer.json` + `tokenizer_config.json` and `generation_config.json`. Tensors use the official
names (`embed.weight`, `layers.N.attn.wq_a.weight`, ..., `head.weight`); drafter weights live under `mtp.S.*`.
Every user-facing problem is a one-line `CheckpointError` (a `ValueError`) naming the file, tensor or field.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from sparkspec.config import ModelConfig
from sparkspec.models.deepseek_v4 import FP32_PARAM_SUFFIXES, DeepseekV4Model
from sparkspec.models.quant import Quantized
from sparkspec.models.weights import (
    CheckpointError,
    TensorSource,
    assign_tensor,
    check_tensors,
    plan_tensors,
    runs_by_bytes,
    stream_tensors,
)
from sparkspec.platform import configure_cpu_threads, current_platform, default_dtype
from sparkspec.tokenizer import Tokenizer, TokenizerError, stdlib_corpus, train_bpe_tokenizer

__all__ = ["CheckpointError", "LoadStats", "LoadedCheckpoint", "init_checkpoint", "load_checkpoint",
           "resolve_dtype", "write_checkpoint"]

DrafterKind = Literal["dspark", "mtp", "both"]
# what happens to FP8 / FP4 checkpoint weights: "keep" them quantised in the layers that can compute on them
# (`models.quantized`), "dequantize" them to the load dtype, or "auto": keep on accelerators, dequantise on CPU
Quantization = Literal["auto", "keep", "dequantize"]
QUANTIZATIONS = ("auto", "keep", "dequantize")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """None -> the platform default (bf16 on accelerators, fp32 on CPU); names like 'bf16' or torch dtypes."""
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype = {dtype!r}: expected one of {sorted(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"dtype = {dtype}: expected one of {sorted(names.values())}")
    return names[dtype]


@dataclass
class LoadStats:
    """What one `load_checkpoint` cost. `peak_rss_increase`: the highest resident set size of the process during
    the load minus the resident set at its start, in bytes; it counts the host copies of the weights, transient
    dequantisation buffers, and the pages of the memory-mapped shard being read (file-backed, but resident).
    `peak_rss_source` says how the peak was taken: 'VmHWM' (Linux: the kernel's high-water mark, reset at the
    start of the load through /proc/self/clear_refs, so the value is the load's own peak) or 'ru_maxrss' (the
    process-lifetime peak: an upper bound when the process had peaked higher before the load)."""

    seconds: float
    bytes_read: int  # tensor data read from the shards, as stored (quantised sizes)
    peak_rss_increase: int
    peak_rss_source: str


@dataclass
class LoadedCheckpoint:
    model: DeepseekV4Model  # eval mode, on the requested device
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the directory has no tokenizer.json
    # every `mtp.*` tensor, official names, on the CPU (owned copies): as stored, except FP8 / FP4 ones,
    # dequantised to the load dtype (fp32 for the parameters kept in fp32). The drafter modules build on the
    # CPU and copy from here; the host holds the drafters' (dequantised) tensors, not the whole checkpoint.
    drafter_tensors: dict[str, torch.Tensor]
    path: Path
    load_stats: LoadStats | None = None
    kept_quantized: tuple[str, ...] = ()  # layers holding FP8 / FP4 weights as stored (`models.quantized`)


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (a checkpoint directory needs config.json)")
    try:
        return ModelConfig.from_file(cfg_file)
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None


def read_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer | None:
    """The directory's tokenizer (None without tokenizer.json), checked against the config: apart from the
    weights so that a tensor-parallel launcher can encode prompts before any rank loads."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        tokenizer = Tokenizer.from_dir(path)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than the model's "
                              f"vocab_size={cfg.vocab_size}")
    return tokenizer


def load_checkpoint(path: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, progress: bool = False, parallel=None,
                    expert_parallel: bool = False, quantization: Quantization = "auto") -> LoadedCheckpoint:
    """Load a checkpoint directory into a target model (official or transformers tensor names).

    `quantization`: what becomes of FP8 / FP4 weights. "keep": the layers that compute on them
    (`models.quantized`: attention and shared-expert projections in FP8, routed experts in FP4) hold them as
    stored, at 1 (FP8) or ~0.53 (FP4) bytes a weight; every other quantised tensor is dequantised to `dtype`;
    a tensor-parallel slice of a kept weight must fall on its scale blocks (else a `CheckpointError` naming the
    tensor). "dequantize": every FP8 / FP4 tensor is dequantised to `dtype`. "auto" (default): "keep" on
    accelerators, where the kept layers run fused kernels (slices off the blocks are then dequantised instead of
    refused), and "dequantize" on the CPU, where computing on quantised weights means dequantising every call.
    A checkpoint without quantised tensors loads the same whatever the choice. `kept_quantized` lists the kept
    layers.

    Parameters that the model keeps in fp32 (mHC, sinks, ape, router bias, `norm` modules) stay fp32 whatever
    `dtype` is. The model is built on the meta device and every tensor is streamed from the shards straight into
    it (`_stream_into`): host memory holds one tensor at a time and the pages of the shard being read (at most
    `weights.REMAP_BYTES` of them), not the checkpoint; the `mtp.*` tensors are kept. `progress`: a byte-counting
    bar on stderr. `load_stats` reports the time, bytes read and peak host memory.

    `parallel`: this rank's `distributed.ParallelGroup`; the meta model is sharded (`tensor_parallel.shard_`,
    whole experts with `expert_parallel`) before any data is read, and only this rank's slices are read, so a
    rank needs memory for its share, not the whole model. Names and shapes are still checked against the
    whole checkpoint, before sharding."""
    start, rss_start, peak_source = time.perf_counter(), _rss_bytes("VmRSS"), _reset_peak_rss()
    path = Path(path)
    dtype = resolve_dtype(dtype)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization = {quantization!r}: expected one of {QUANTIZATIONS}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    cfg = read_config(path)
    device = torch.device(device) if device is not None else current_platform().device
    if device.type == "cpu":
        configure_cpu_threads(cfg.hidden_size)
    tokenizer = read_tokenizer(path, cfg)  # read first: a broken tokenizer fails before the weights load
    plan = plan_tensors(path)  # headers only: names, dtypes and shapes are checked before any data is read
    if cfg.tie_word_embeddings and "head.weight" not in plan and "embed.weight" in plan:
        plan["head.weight"] = plan["embed.weight"]
    model = meta_model(cfg, dtype)
    targets = _targets(model)
    check_tensors({n: tuple(t.shape) for n, t in targets.items()},
                  {n: src.shape for n, src in plan.items()}, str(path))
    if parallel is not None and parallel.world_size > 1:
        targets, plan = _shard_plan(model, plan, parallel, expert_parallel)
    kept: list[str] = []
    if quantization == "keep" or (quantization == "auto" and device.type != "cpu"):
        from sparkspec.models.quantized import keep_quantized_

        kept = keep_quantized_(model, plan, strict=quantization == "keep")
        targets = _targets(model)
    drafter_tensors = _stream_into(model, targets, plan, device, dtype, path, progress)
    _move_computed(model, device)
    _check_materialised(model)
    model.eval()
    peak = _rss_bytes("VmHWM") if peak_source == "VmHWM" else _maxrss_bytes()
    stats = LoadStats(time.perf_counter() - start, sum(src.nbytes for src in plan.values()),
                      max(peak - rss_start, 0), peak_source)
    return LoadedCheckpoint(model, cfg, tokenizer, drafter_tensors, path, stats, tuple(kept))


def _shard_plan(model: DeepseekV4Model, plan: dict[str, TensorSource], pg, expert_parallel: bool
                ) -> tuple[dict[str, torch.Tensor], dict[str, TensorSource]]:
    """Shard the meta model for this rank and plan what it reads: each parameter's cut of its checkpoint
    tensor (under the parameter's name), the `mtp.*` tensors whole, nothing of the experts other ranks hold."""
    from sparkspec.distributed.tensor_parallel import shard_

    cuts = shard_(model, pg, expert_parallel)
    targets = _targets(model)
    sharded = {n: plan[n] for n in plan if n.startswith("mtp.")}
    for name in targets:
        cut = cuts.get(name)
        if cut is None:
            sharded[name] = plan[name]
        else:
            part = None if cut.dim is None else (cut.dim, cut.start, cut.stop)
            sharded[name] = replace(plan[cut.source], cut=part)
    return targets, sharded


def _targets(model: DeepseekV4Model) -> dict[str, torch.Tensor]:
    """Everything the checkpoint fills: parameters and the buffers that are not computed (RoPE `inv_freq`)."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if not n.endswith("inv_freq"))
    return targets


class _MetaInit(torch.overrides.TorchFunctionMode):
    """Inside `torch.device("meta")`: `torch.arange` (and so everything computed from it, the RoPE frequencies
    of `Attention.__init__`) runs on the CPU, so tensors that `__init__` computes are real, with the model's own
    values, while parameters and buffers that are only allocated stay on meta. Initialisers on meta tensors are
    skipped: they have no data to fill, and torch's meta kernels for them import sympy (~150 MB of host memory)."""

    INITS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                       "xavier_uniform_", "xavier_normal_", "orthogonal_", "zero_", "zeros_", "ones_", "fill_",
                       "constant_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange:
            kwargs["device"] = "cpu"
        elif getattr(func, "__name__", None) in self.INITS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def meta_model(cfg: ModelConfig, dtype: torch.dtype) -> DeepseekV4Model:
    """The target model on the meta device (no memory, no init work), each parameter already in the dtype it
    will be loaded in: `dtype`, or fp32 where `keep_fp32` keeps it (the model's own rule, not a copy of it).
    RoPE frequencies are real CPU tensors (`_MetaInit`); `_move_computed` puts them on the device."""
    with torch.device("meta"), _MetaInit():
        model = DeepseekV4Model(cfg)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.keep_fp32()


def _stream_into(model: DeepseekV4Model, targets: dict[str, torch.Tensor], plan: dict[str, TensorSource],
                 device: torch.device, dtype: torch.dtype, path: Path, progress: bool) -> dict[str, torch.Tensor]:
    """Read every tensor once, in file order: the target's go onto `device` in their parameter's dtype and
    replace the meta tensors; the `mtp.*` ones stay on the CPU and are returned (plain ones as stored, which is
    what the drafters copy from; quantised ones dequantised to `dtype`, the dtype the drafters are placed in)."""
    cpu = torch.device("cpu")

    def place(name: str) -> tuple[torch.device, torch.dtype | None]:
        if name in targets:
            return device, targets[name].dtype
        if plan[name].quant is None:
            return cpu, None
        return cpu, torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype

    drafter: dict[str, torch.Tensor] = {}
    for name, t in stream_tensors(plan, place, progress=progress):
        if isinstance(t, Quantized):  # a kept layer's weight: codes and scales installed side by side
            assign_tensor(model, name, t.data)
            assign_tensor(model, name.removesuffix("weight") + "scale", t.scale)
        elif name in targets:
            if name.endswith("tid2eid"):
                _check_tid2eid(model.cfg, name, t, path)
            assign_tensor(model, name, t)
        else:  # only `mtp.*` gets here: check_tensors refused anything else
            drafter[name] = t
    return dict(sorted(drafter.items()))


def _check_tid2eid(cfg: ModelConfig, name: str, t: torch.Tensor, path: Path) -> None:
    if t.numel() and not (0 <= int(t.min()) and int(t.max()) < cfg.n_routed_experts):
        raise CheckpointError(f"{path}: tensor '{name}' holds expert ids in [{int(t.min())}, {int(t.max())}], "
                              f"expected [0, {cfg.n_routed_experts})")


def _move_computed(model: DeepseekV4Model, device: torch.device) -> None:
    """Move what `__init__` computed (buffers that are not in the checkpoint, such as RoPE `inv_freq`, and plain
    tensor attributes such as its fp32 master copy `inv_freq_fp32`) from the CPU to `device`."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                module._buffers[name] = b.to(device)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and not value.is_meta and value.device != device:
                setattr(module, name, value.to(device))


def _check_materialised(model: DeepseekV4Model) -> None:
    """No meta tensor may survive the load (a buffer or tensor attribute added to the model later that the
    loader does not know how to compute would otherwise fail only at the first forward, obscurely)."""
    for mod_name, module in model.named_modules():
        for attr, value in [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise AssertionError(f"'{mod_name}.{attr}' is still on the meta device after loading: "
                                     "load_checkpoint does not know how to materialise it")


def _reset_peak_rss() -> str:
    """Reset the kernel's resident-set high-water mark (Linux); 'VmHWM' when that worked, else 'ru_maxrss'."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM" if _rss_bytes("VmHWM") else "ru_maxrss"
    except OSError:
        return "ru_maxrss"


def _rss_bytes(field: str) -> int:
    """`field` (VmRSS, VmHWM) of /proc/self/status in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _maxrss_bytes() -> int:
    """Process-lifetime peak resident set (kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


# ---------------------------------------------------------------- writing


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Official tensor name -> (shape, dtype) of the target model, computed without allocating weights."""
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def _check_state(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"state dict: missing tensor '{missing[0]}' ({len(missing)} missing)")
    extra = sorted(k for k in set(tensors) - set(expected) if not k.startswith("mtp."))
    if extra:
        raise CheckpointError(f"state dict: unexpected tensor '{extra[0]}' ({len(extra)} unexpected)")
    for k, (shape, _) in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise CheckpointError(f"state dict: tensor '{k}' has shape {tuple(tensors[k].shape)}, expected {shape}")


def _storage_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Detached, contiguous CPU copy; floats cast to `dtype` except the parameters kept in fp32."""
    t = t.detach().to("cpu")
    if dtype is not None and t.is_floating_point() and not name.endswith(FP32_PARAM_SUFFIXES):
        t = t.to(dtype)
    return t.contiguous().clone()  # clone: safetensors refuses tensors that share storage


def _shards(names: list[str], tensors: dict[str, torch.Tensor], shard_size_bytes: int) -> list[list[str]]:
    return runs_by_bytes(names, {k: tensors[k].numel() * tensors[k].element_size() for k in names},
                         shard_size_bytes)


def _save_file(tensors: dict, path: Path, metadata: dict) -> None:
    """safetensors' `save_file` writes through a private temporary file (mode 0600); give the weights the mode
    every other file of the checkpoint gets (0666 less the umask), so whoever may read config.json may load it."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_checkpoint(model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                     out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                     extra_tensors: dict[str, torch.Tensor] | None = None, shard_size_bytes: int | None = None,
                     dtype: str | torch.dtype | None = None) -> Path:
    """Write a checkpoint directory in the official layout.

    `model_or_state_dict`: a `DeepseekV4Model` or a state dict under official names (may already contain `mtp.*`);
    `extra_tensors`: more tensors to store, normally drafter weights `mtp.S.*`; `tokenizer_dir`: copy its tokenizer
    files; `shard_size_bytes`: split into `model-0000i-of-0000n.safetensors` + index; `dtype`: storage dtype of
    floating tensors (fp32-kept parameters stay fp32), None = as given. Returns `out_dir`."""
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) \
        else dict(model_or_state_dict)
    for k, t in (extra_tensors or {}).items():
        if k in state:
            raise CheckpointError(f"extra tensor '{k}' is already in the state dict")
        state[k] = t
    _check_state(cfg, state)
    store_dtype = resolve_dtype(dtype) if dtype is not None else None
    tensors = {k: _storage_tensor(k, state[k], store_dtype) for k in sorted(state)}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_FILE]:  # stale shards would be read back
        old.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if shard_size_bytes is None:
        _save_file(tensors, out_dir / "model.safetensors", meta)
    else:
        if shard_size_bytes < 1:
            raise ValueError(f"shard_size_bytes = {shard_size_bytes}: expected a positive integer")
        groups = _shards(list(tensors), tensors, shard_size_bytes)
        weight_map = {}
        for i, names in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            _save_file({k: tensors[k] for k in names}, out_dir / fname, meta)
            weight_map.update({k: fname for k in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    cfg = replace(cfg, torch_dtype=dtype_name(tensors["embed.weight"].dtype))  # what the file really holds
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != out_dir.resolve():
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                (out_dir / name).write_bytes(src.read_bytes())
    return out_dir


# ---------------------------------------------------------------- random checkpoints


def random_target_tensors(cfg: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random fp32 weights under official names (int64 `tid2eid`), by `random_init.init_rule`: scaled so that a
    random model still emits varied tokens (logits of std ~2)."""
    from sparkspec.models.random_init import init_rule

    out = {}
    for name, (shape, dtype) in expected_shapes(cfg).items():
        out[name] = torch.empty(shape, dtype=dtype if name.endswith("tid2eid") else torch.float32)
        init_rule(name, out[name], shape[-1] if len(shape) == 2 else 0, generator, cfg)
    return out


def random_drafter_tensors(cfg: ModelConfig, drafter: DrafterKind | None,
                           generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`mtp.*` tensors for the requested drafter(s), made by the drafter modules themselves
    (`init_dspark_tensors` / `init_mtp_tensors`; with 'both' the MTP layers follow the DSpark stages)."""
    if drafter is None:
        return {}
    if drafter not in ("dspark", "mtp", "both"):
        raise ValueError(f"drafter = {drafter!r}: expected None, 'dspark', 'mtp' or 'both'")
    if drafter in ("dspark", "both") and not cfg.has_dspark:
        raise ValueError("drafter 'dspark' needs config fields 'dspark_block_size' and 'dspark_target_layer_ids'")
    if drafter in ("mtp", "both") and cfg.num_nextn_predict_layers < 1:
        raise ValueError("drafter 'mtp' needs config field 'num_nextn_predict_layers' >= 1")
    from sparkspec.models.mtp import init_drafter_tensors  # stage numbering of 'both' lives there

    return init_drafter_tensors(cfg, generator, drafter)


def init_checkpoint(preset_or_config: str | ModelConfig | dict, out_dir: str | Path, seed: int = 0,
                    drafter: DrafterKind | None = None, shard_size_bytes: int | None = None,
                    dtype: str = "float32") -> Path:
    """Write a random checkpoint (official layout, BPE tokenizer trained offline) for a preset name, a
    `ModelConfig` or a config dict. The same arguments give byte-identical tensors."""
    if isinstance(preset_or_config, ModelConfig):
        cfg = preset_or_config
    elif isinstance(preset_or_config, dict):
        cfg = ModelConfig.from_dict(preset_or_config)
    else:
        cfg = ModelConfig.preset(preset_or_config)
    store_dtype = resolve_dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    state = random_target_tensors(cfg, gen)
    extra = random_drafter_tensors(cfg, drafter, gen)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.vocab_size >= 256 + 6:  # byte-level BPE needs 256 byte tokens + the special tokens
        train_bpe_tokenizer(stdlib_corpus(), cfg.vocab_size, out_dir)
    return write_checkpoint(state, cfg, out_dir, extra_tensors=extra, shard_size_bytes=shard_size_bytes,
                            dtype=store_dtype)
