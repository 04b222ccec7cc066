"""Reading a planned checkpoint (`loading.plan`), one tensor at a time, onto the device it is placed on.

A quantised tensor is dequantised where it is placed, unless its placement asks for its stored format
(`KEPT_DTYPES`): it then arrives as `Quantized(data, scale)` (FP8 codes with fp32 block scales, FP4 packed bytes
with e8m0 exponent bytes). A loader never holds more than one tensor of the file in host memory, plus the pages
of the shard being read (`REMAP_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from sparkspec.loading import CheckpointError
from sparkspec.loading.plan import READ_ERRORS, TensorSource, cut_region, keep_problem, open_shard, plan_tensors
from sparkspec.ops.formats import Quantized, dequant_fp4, dequant_fp8_block, e8m0_bytes, scale_to_float

REMAP_BYTES = 1 << 30  # a shard is reopened after this much data: see `_mapping_groups`
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
    with open_shard(f) as sf:
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
    region = cut_region(src)
    raw = _read_index(sf, f, src.key, region.index)
    scale = None
    if src.scale is not None:
        if src.scale.file == f:
            scale = _read_index(sf, f, src.scale.key, region.scale_index)
        else:
            with open_shard(src.scale.file) as other:
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
    with open_shard(scale.file) as other:
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
