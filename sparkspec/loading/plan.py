"""Planning a checkpoint read from the safetensors headers alone: which file holds each tensor (official name),
its stored dtype and shape, its block scale, and, for a tensor-parallel rank, which cut of it is wanted.

Every check that needs no tensor data fails here, before a byte of weights is read (`plan_tensors`); the
reading itself is `loading.stream`. A quantised tensor may stay in its stored format only when a cut of it
falls on whole scale blocks (`keep_problem`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sparkspec.loading import CheckpointError
from sparkspec.loading.names import FUSED_EXPERTS, official_name
from sparkspec.ops.formats import FP4_BLOCK, FP8_BLOCK, fp4_scale_shape, fp8_scale_shape


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
            region = cut_region(self)
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
class Region:
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


def cut_region(src: TensorSource) -> Region:
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
    return Region(index, tuple(scale_index), start - lo)


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


def open_shard(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except READ_ERRORS as e:
        raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None


def _header(f: Path) -> list[TensorSource]:
    with open_shard(f) as sf:
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
