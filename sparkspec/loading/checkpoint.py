"""Loading a checkpoint directory (HF / official DeepSeek layout, see `loading.save`) into a target model on its
device: config, tokenizer, and the weights streamed from the shards straight into a model built on the meta
device; the drafters' `mtp.*` tensors are kept on the host for `loading.drafters`.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sparkspec.config import ModelConfig
from sparkspec.loading import CheckpointError
from sparkspec.loading.meta import check_materialised, meta_model, move_computed
from sparkspec.loading.plan import TensorSource, plan_tensors
from sparkspec.loading.quantized import QUANTIZATIONS, Quantization, keep_quantized_
from sparkspec.loading.state import assign_tensor, check_tensors
from sparkspec.loading.stream import stream_tensors
from sparkspec.models.deepseek_v4 import FP32_PARAM_SUFFIXES, DeepseekV4Model
from sparkspec.ops.formats import Quantized
from sparkspec.platform import configure_cpu_threads, current_platform, default_dtype
from sparkspec.tokenizer import Tokenizer, TokenizerError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


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
    kept_quantized: tuple[str, ...] = ()  # layers holding FP8 / FP4 weights as stored (`loading.quantized`)

    @property
    def has_dspark_weights(self) -> bool:
        """The config declares a DSpark drafter and its weights are present (what `speculative="auto"` picks)."""
        return self.config.has_dspark and any(k.endswith("main_proj.weight") for k in self.drafter_tensors)


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
    (`loading.quantized`: attention and shared-expert projections in FP8, routed experts in FP4) hold them as
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
    `stream.REMAP_BYTES` of them), not the checkpoint; the `mtp.*` tensors are kept. `progress`: a byte-counting
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
        kept = keep_quantized_(model, plan, strict=quantization == "keep")
        targets = _targets(model)
    drafter_tensors = _stream_into(model, targets, plan, device, dtype, path, progress)
    move_computed(model, device)
    check_materialised(model)
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
