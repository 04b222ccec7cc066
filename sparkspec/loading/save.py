"""Writing checkpoint directories in the official DeepSeek layout.

A directory holds `config.json` (official form), `model.safetensors` or shards + `model.safetensors.index.json`,
optionally `tokenizer.json` + `tokenizer_config.json` and `generation_config.json`. Tensors use the official
names (`embed.weight`, `layers.N.attn.wq_a.weight`, ..., `head.weight`); drafter weights live under `mtp.S.*`.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparkspec.config import ModelConfig
from sparkspec.loading import CheckpointError
from sparkspec.loading.checkpoint import dtype_name, resolve_dtype
from sparkspec.loading.meta import expected_shapes
from sparkspec.loading.stream import runs_by_bytes
from sparkspec.models.deepseek_v4 import FP32_PARAM_SUFFIXES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
INDEX_FILE = "model.safetensors.index.json"


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
