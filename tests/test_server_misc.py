"""Small checks around serving that need no server: SamplingParams' seed range and the file modes that
`sparkspec init` writes (a server run by another user must be able to read the weights it can see)."""

from __future__ import annotations

import os
import stat

import pytest

from sparkspec.sampling_params import SamplingParams


@pytest.mark.parametrize("seed, stored", [(0, 0), (-(2**63), -(2**63)), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)),
                                          (2**64 - 1, -1), (None, None)])
def test_seed_in_range_is_kept_as_int64(seed, stored):
    assert SamplingParams(seed=seed).seed == stored


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, True, "3"])
def test_seed_out_of_range_names_seed(seed):
    with pytest.raises(ValueError, match="^seed = "):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("shard_size_bytes", [None, 200_000])
def test_init_writes_every_file_with_one_mode(tmp_path, shard_size_bytes):
    from sparkspec.loading.random_init import init_checkpoint

    old = os.umask(0o022)
    try:
        out = init_checkpoint("tiny", tmp_path / "ckpt", seed=0, shard_size_bytes=shard_size_bytes)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert any(n.endswith(".safetensors") for n in modes) and "config.json" in modes
    assert set(modes.values()) == {0o644}, modes
