"""Checkpoint reading: config + safetensors shards, name mapping tables, FP8/FP4 dequantisation.

Accepted tensor names:
* official DeepSeek names (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
  `layers.N.ffn.gate.bias`, `hc_head_fn`, `head.weight`, `mtp.S.*`) — the model's own names;
* what transformers' `save_pretrained` writes (`model.` prefix, `model.embed_tokens.weight`,
  `model.hc_head.hc_fn`, `attn.norm.weight` for the KV norm), and transformers' module names
  (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj`, `lm_head.weight`, ...), through `TRANSFORMERS_RENAMES`.

Reading is planned from the shards' headers first (`plan_tensors`: names, dtypes, shapes, scale pairing; every
check that needs no tensor data fails here, before a byte of weights is read), then streamed one tensor at a
time (`stream_tensors`), so a loader never holds more than one tensor of the file in host memory.

A quantised tensor is dequantised where it is placed, unless its placement asks for its stored format
(`KEPT_DTYPES`): it then arrives as `Quantized(data, scale)` (FP8 codes with fp32 block scales, FP4 packed bytes
with e8m0 exponent bytes), and a cut of it must fall on whole scale blocks (`keep_problem`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sparkspec.models.quant import (
    FP4_BLOCK,
    FP8_BLOCK,
    Quantized,
    dequant_fp4,
    dequant_fp8_block,
    e8m0_bytes,
    fp4_scale_shape,
    fp8_scale_shape,
    scale_to_float,
)

# (pattern, replacement) applied in order to names that are not official yet
TRANSFORMERS_RENAMES: list[tuple[str, str]] = [
    (r"^model\.", ""),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.weight_scale_inv$", ".scale"),
]


class CheckpointError(ValueError):
    """A user-facing problem with a checkpoint directory (missing file/tensor, wrong shape, dtype)."""


def official_name(name: str) -> str:
    for pat, rep in TRANSFORMERS_RENAMES:
        name = re.sub(pat, rep, name)
    return name


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


# safetensors header dtype -> torch dtype (names torch lacks stay strings: they are reported, never loaded)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", "F8_E8M0"),
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_PACKED_DTYPES = (torch.int8, torch.uint8)  # FP4 when a '.scale' goes with it
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
# what safetensors raises on a corrupt or truncated file (its own error for headers, others for data)
READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError)
REMAP_BYTES = 1 << 30  # a shard is reopened after this much data: see `_mapping_groups`
FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor (official name) is stored: a whole stored tensor, or one expert's part of transformers'
    fused expert tensors; with its block scale when quantised. Known from the header alone."""

    file: Path
    key: str  # name inside the file
    dtype: torch.dtype | str  # as stored
    stored_shape: tuple[int, ...]
    expert: int | None = None  # row of a fused [E, ...] tensor
    half: int | None = None  # gate_up_proj rows: 0 = w1 (gate), 1 = w3 (up)
    scale: TensorSource | None = None
    # (dim, start, stop): only this part of the tensor the model receives (a tensor-parallel rank's slice)
    cut: tuple[int, int, int] | None = None

    @property
    def quant(self) -> str | None:
        if self.dtype in FP8_DTYPES:
            return "fp8"
        return "fp4" if self.dtype in FP4_PACKED_DTYPES and self.scale is not None else None

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of what is read from the file (one expert's row of a fused tensor)."""
        return self.stored_shape[1:] if self.expert is not None else self.stored_shape

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the tensor the model receives: a half of a gate_up row, FP4 unpacked to two values a byte."""
        shape = list(self.row_shape)
        if self.half is not None:  # torch.chunk(2): the first half gets the odd row
            first = (shape[0] + 1) // 2
            shape[0] = first if self.half == 0 else shape[0] - first
        if self.quant == "fp4":
            shape[-1] *= 2
        if self.cut is not None:
            shape[self.cut[0]] = self.cut[2] - self.cut[1]
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of stored data this tensor reads (its scale included; of a cut, the covering blocks)."""
        if self.cut is not None:
            region = _cut_region(self)
            size = getattr(self.dtype, "itemsize", 0) * _numel(_region_shape(region.index, self.stored_shape))
            if self.scale is not None:
                scale_shape = _region_shape(region.scale_index, self.scale.stored_shape)
                size += getattr(self.scale.dtype, "itemsize", 0) * _numel(scale_shape)
            return size
        size = getattr(self.dtype, "itemsize", 0) * _numel(self.row_shape)
        size = size // 2 if self.half is not None else size
        return size + (self.scale.nbytes if self.scale is not None else 0)


def keep_problem(src: TensorSource) -> str | None:
    """Why `src` cannot arrive in its stored format (None: it can): not quantised, half of a fused tensor, or a
    tensor-parallel cut whose ends are not on scale-block boundaries (a kept block needs all of its values)."""
    if src.quant is None:
        return "it is not quantised"
    if src.quant == "fp8" and src.dtype != torch.float8_e4m3fn:
        return f"it is stored as {src.dtype}, the kept format is float8_e4m3fn"
    if src.half is not None:
        return "it is half of a fused gate_up tensor"
    if src.cut is None:
        return None
    dim, start, stop = src.cut
    block, pack = _block(src, dim)
    full = _full_dim(src, dim)
    if start % block or (stop % block and stop != full) or start % pack or (stop - start) % pack:
        return (f"this rank's slice {start}:{stop} of dim {dim} (of {full}) does not fall on the "
                f"{block}-wide scale blocks")
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class _Region:
    """What a cut source reads: `index` into the stored tensor and `scale_index` into its scale, both covering
    whole quantisation blocks (a block's values need its scale, and dequantising needs whole blocks), and
    `trim`: the offset of the wanted part inside the dequantised piece along the cut's dim."""

    index: tuple
    scale_index: tuple
    trim: int


def _block(src: TensorSource, dim: int) -> tuple[int, int]:
    """(values per scale, values per stored element) along `dim` of the tensor the model receives."""
    if src.quant == "fp8":
        return FP8_BLOCK, 1
    if src.quant == "fp4":
        return (1, 1) if dim == 0 else (FP4_BLOCK, 2)
    return 1, 1


def _cut_region(src: TensorSource) -> _Region:
    """The stored part that holds `src.cut`, widened to whole scale blocks."""
    dim, start, stop = src.cut
    rows = list(src.row_shape)
    block, pack = _block(src, dim)
    first, last = start // block, -(-stop // block)
    lo, hi = first * block, min(last * block, _full_dim(src, dim))
    span = [slice(0, n) for n in rows]
    if src.half is not None:  # gate_up rows: the half's own rows (torch.chunk: the first half gets the odd row)
        half_rows = (rows[0] + 1) // 2
        span[0] = slice(0, half_rows) if src.half == 0 else slice(half_rows, rows[0])
    base = span[dim].start
    span[dim] = slice(base + lo // pack, base + -(-hi // pack))
    scale_index = [slice(None)] * len(rows)
    scale_index[dim] = slice(first, last)
    index = ((src.expert,) if src.expert is not None else ()) + tuple(span)
    return _Region(index, tuple(scale_index), start - lo)


def _full_dim(src: TensorSource, dim: int) -> int:
    """Length of `dim` of the uncut tensor the model receives."""
    return replace(src, cut=None).shape[dim]


def _region_shape(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of `tensor[index]` for ints and slices (ints drop their dim)."""
    out = []
    for i, n in enumerate(shape):
        k = index[i] if i < len(index) else slice(None)
        if isinstance(k, slice):
            out.append(len(range(*k.indices(n))))
    return tuple(out)


def _split_fused_experts(name: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> bool:
    """transformers' module layout stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    m = FUSED_EXPERTS.match(name)
    if not m:
        return False
    for e in range(t.shape[0]):
        if m.group(2) == "gate_up_proj":
            w1, w3 = t[e].chunk(2, dim=0)
            out[f"{m.group(1)}.{e}.w1.weight"], out[f"{m.group(1)}.{e}.w3.weight"] = w1, w3
        else:
            out[f"{m.group(1)}.{e}.w2.weight"] = t[e]
    return True


def _split_fused_source(name: str, src: TensorSource) -> dict[str, TensorSource]:
    """`_split_fused_experts` on a header entry: one source per expert part, read later row by row."""
    m = FUSED_EXPERTS.match(name)
    if not m:
        return {name: src}
    if len(src.stored_shape) != 3:
        raise CheckpointError(f"{src.file}: fused experts '{src.key}' have shape {src.stored_shape}, "
                              "expected [experts, out, in]")
    out = {}
    for e in range(src.stored_shape[0]):
        if m.group(2) == "gate_up_proj":
            out[f"{m.group(1)}.{e}.w1.weight"] = replace(src, expert=e, half=0)
            out[f"{m.group(1)}.{e}.w3.weight"] = replace(src, expert=e, half=1)
        else:
            out[f"{m.group(1)}.{e}.w2.weight"] = replace(src, expert=e)
    return out


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except READ_ERRORS as e:
        raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None


def _header(f: Path) -> list[TensorSource]:
    with _open(f) as sf:
        try:
            slices = [(k, sf.get_slice(k)) for k in sf.keys()]  # noqa: SIM118 (not a dict)
        except READ_ERRORS as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        return [TensorSource(f, k, SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()), tuple(s.get_shape()))
                for k, s in slices]


def plan_tensors(path: Path) -> dict[str, TensorSource]:
    """Official name -> source of every tensor of the checkpoint, from the headers only. A `.scale` (or
    `weight_scale_inv`) next to a `.weight` is attached to it; FP8 without a scale, dtypes the loader cannot
    take and scales of the wrong shape are errors here, so they cost no reading."""
    raw: dict[str, TensorSource] = {}
    for f in checkpoint_files(path):
        for src in _header(f):
            raw.update(_split_fused_source(official_name(src.key), src))
    out = {}
    for name, src in raw.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in raw:
            continue  # consumed with its weight
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        out[name] = _checked(name, replace(src, scale=scale) if scale is not None else src)
    return out


def _checked(name: str, src: TensorSource) -> TensorSource:
    """The checks `read_tensors` made on data, made on the header: dtype, FP8 scale present, scale shapes."""
    if src.dtype in FP8_DTYPES and src.scale is None:
        raise CheckpointError(f"tensor '{name}': FP8 weight without a '.scale' / 'weight_scale_inv'")
    if src.quant is None and src.dtype not in PLAIN_DTYPES:
        raise CheckpointError(f"tensor '{name}': unsupported dtype {src.dtype}")
    if src.quant is not None:
        if len(src.row_shape) != 2:
            raise CheckpointError(f"tensor '{name}': {src.quant.upper()} weight has shape {src.row_shape}, "
                                  "expected [out, in]")
        need = fp8_scale_shape(src.row_shape) if src.quant == "fp8" else fp4_scale_shape(src.shape)
        if src.scale.stored_shape != need:
            raise CheckpointError(f"tensor '{name}': {src.quant.upper()} block scale has shape "
                                  f"{src.scale.stored_shape}, expected {need}")
    return src


# ---------------------------------------------------------------- streaming


Placement = Callable[[str], tuple[torch.device, torch.dtype | None]]  # name -> (device, dtype; None = as stored)


def stream_tensors(plan: dict[str, TensorSource], place: Placement,
                   progress: bool = False) -> Iterator[tuple[str, torch.Tensor | Quantized]]:
    """Yield (name, tensor) for every entry of `plan`, shard by shard, each tensor an owned copy on its
    `place(name)` device and dtype (FP8 / FP4 dequantised there; None: fp32 when quantised, else as stored;
    a quantised tensor placed in `KEPT_DTYPES` arrives as `Quantized`)."""
    from tqdm import tqdm

    by_file: dict[Path, list[str]] = {}
    for name, src in plan.items():
        by_file.setdefault(src.file, []).append(name)
    total = sum(src.nbytes for src in plan.values())
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, disable=not progress) as bar:
        for f in sorted(by_file):
            for names in _mapping_groups(by_file[f], plan):
                for name, t in _stream_group(f, names, plan, place):
                    bar.update(plan[name].nbytes)
                    yield name, t


def runs_by_bytes(names: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive runs of names holding at most `limit` bytes each (a single larger item gets a run of its own):
    how the writer cuts shards and the loader groups its reads."""
    runs: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = nbytes[name]
        if runs[-1] and size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(name)
        size += n
    return runs


def _mapping_groups(names: list[str], plan: dict[str, TensorSource]) -> list[list[str]]:
    """Consecutive runs of at most `REMAP_BYTES` of data (or one tensor). safetensors maps a shard once per
    open handle, and every page read stays resident (file-backed, but counted in the resident set) until the
    handle closes; reopening the shard per run keeps that to about `REMAP_BYTES` whatever the shard size."""
    return runs_by_bytes(names, {name: plan[name].nbytes for name in names}, REMAP_BYTES)


def _stream_group(f: Path, names: list[str], plan: dict[str, TensorSource],
                  place: Placement) -> Iterator[tuple[str, torch.Tensor]]:
    with _open(f) as sf:
        row: tuple[tuple, torch.Tensor] | None = None  # the last fused row read: w1 and w3 share it
        for name in names:
            src = plan[name]
            if src.cut is not None:
                yield name, _read_cut(sf, f, name, src, place)
                continue
            if src.expert is not None and (row is None or row[0] != (src.key, src.expert)):
                row = ((src.key, src.expert), _read(sf, f, src.key, src.expert))
            raw = row[1] if src.expert is not None else _read(sf, f, src.key)
            if src.half is not None:
                raw = raw.chunk(2, dim=0)[src.half]
            scale = None if src.scale is None else _read_scale(sf, f, src.scale)
            device, dtype = place(name)
            yield name, materialise(name, src, raw, scale, device, dtype)


def _read(sf, f: Path, key: str, expert: int | None = None) -> torch.Tensor:
    """One stored tensor (or one row of it). The result maps the file: copy before keeping it."""
    try:
        return sf.get_tensor(key) if expert is None else sf.get_slice(key)[expert]
    except READ_ERRORS as e:
        raise CheckpointError(f"{f}: cannot read tensor '{key}' ({e})") from None


def _read_cut(sf, f: Path, name: str, src: TensorSource, place: Placement) -> torch.Tensor:
    """A rank's slice: the covering blocks are read (with their scales), dequantised and trimmed to the cut."""
    region = _cut_region(src)
    raw = _read_index(sf, f, src.key, region.index)
    scale = None
    if src.scale is not None:
        if src.scale.file == f:
            scale = _read_index(sf, f, src.scale.key, region.scale_index)
        else:
            with _open(src.scale.file) as other:
                scale = _read_index(other, src.scale.file, src.scale.key, region.scale_index).clone()
    device, dtype = place(name)
    if dtype in KEPT_DTYPES and keep_problem(src) is not None:
        raise CheckpointError(f"tensor '{name}' cannot stay quantised: {keep_problem(src)}")
    t = materialise(name, replace(src, cut=None), raw, scale, device, dtype)
    if isinstance(t, Quantized):  # on whole blocks: the region is the cut
        return t
    dim, start, stop = src.cut
    if t.shape[dim] == stop - start:
        return t
    return t.narrow(dim, region.trim, stop - start).clone()  # clone: drop the rest of the covering blocks


def _read_index(sf, f: Path, key: str, index: tuple) -> torch.Tensor:
    try:
        return sf.get_slice(key)[index]
    except READ_ERRORS as e:
        raise CheckpointError(f"{f}: cannot read tensor '{key}' ({e})") from None


def _read_scale(sf, f: Path, scale: TensorSource) -> torch.Tensor:
    """Scales are small; one stored in another shard is read through a short-lived handle of its own."""
    if scale.file == f:
        return _read(sf, f, scale.key)
    with _open(scale.file) as other:
        return _read(other, scale.file, scale.key).clone()


KEPT_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # a placement in these keeps FP8 / FP4 as stored


def materialise(name: str, src: TensorSource, raw: torch.Tensor, scale: torch.Tensor | None,
                device: torch.device, dtype: torch.dtype | None) -> torch.Tensor | Quantized:
    """An owned tensor on `device` in `dtype`. Quantised data crosses to the device as stored (1 byte or half
    a byte a value) and is dequantised there, straight to `dtype`; plain data is cast on the device too. A
    quantised tensor placed in `KEPT_DTYPES` stays as stored: `Quantized(data, scale)`, FP8 with fp32 scales,
    FP4 as uint8 bytes with e8m0 exponent bytes."""
    if src.quant is not None and dtype in KEPT_DTYPES:
        if src.quant == "fp8":
            return Quantized(raw.to(device, copy=True), scale_to_float(scale.to(device, copy=True)))
        try:
            exponents = e8m0_bytes(scale.to(device, copy=True), name)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return Quantized(raw.to(device, copy=True).view(torch.uint8), exponents)
    if src.quant is not None:
        w, s, dtype = raw.to(device), scale.to(device), dtype or torch.float32
        return dequant_fp8_block(w, s, name, dtype) if src.quant == "fp8" else dequant_fp4(w, s, name, dtype)
    dtype = dtype or raw.dtype
    if device.type == "cpu":
        return raw.to(dtype=dtype, copy=True)  # copy: `raw` maps the file
    return raw.to(device).to(dtype)


def read_tensors(path: Path, progress: bool = False) -> dict[str, torch.Tensor]:
    """All tensors under official names on the CPU, dequantised to fp32 where the checkpoint is FP8/FP4 (the
    whole checkpoint in memory: for tests and tools; `load_checkpoint` streams instead)."""
    cpu = torch.device("cpu")
    return dict(stream_tensors(plan_tensors(path), lambda name: (cpu, None), progress=progress))


# ---------------------------------------------------------------- installing


def check_tensors(expected: dict[str, tuple[int, ...]], have: dict[str, tuple[int, ...]], source: str,
                  prefix: str = "", allow_extra: tuple[str, ...] = ("mtp.",)) -> None:
    """Names and shapes of a checkpoint against a model: `expected` (model names -> shape) against `have`
    (names relative to `prefix` -> shape). One function for `load_state` and the streaming loader, so both
    word a missing, unexpected or misshapen tensor the same way."""
    missing = sorted(set(expected) - set(have))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor '{prefix}{missing[0]}'{more}")
    extra = sorted(n for n in set(have) - set(expected) if not (prefix + n).startswith(allow_extra))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{source}: unexpected tensor '{prefix}{extra[0]}'{more}")
    for n in sorted(expected):
        if tuple(have[n]) != tuple(expected[n]):
            raise CheckpointError(f"{source}: tensor '{prefix}{n}' has shape {tuple(have[n])}, "
                                  f"expected {tuple(expected[n])}")


def assign_tensor(model: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    """Install `t` as parameter or buffer `name` of `model` in place of what is there (a meta tensor when the
    model was built on the meta device): no copy, so the model never holds a second set of weights."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(t, requires_grad=module._parameters[attr].requires_grad)
    elif attr in module._buffers:
        module._buffers[attr] = t
    else:
        raise KeyError(f"'{name}' is neither a parameter nor a buffer of {type(model).__name__}")


def load_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "",
               source: str = "checkpoint", allow_extra: tuple[str, ...] = ("mtp.",)) -> None:
    """Copy `tensors` into `model` (names relative to `prefix`); every parameter must be present with its shape."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {n: tuple(p.shape) for n, p in params.items() if not n.endswith("inv_freq")}
    have = {n[len(prefix):]: tuple(t.shape) for n, t in tensors.items() if n.startswith(prefix)}
    check_tensors(expected, have, source, prefix, allow_extra)
    with torch.no_grad():
        for n in expected:
            p = params[n]
            p.copy_(tensors[prefix + n].to(p.dtype))
