"""The two copies of a step, by name: host ints to the device once, device results to the host once.

    up = Upload(); up.add("seeds", seeds); ...; dev = up.split(device_tensor)   # dev["seeds"] -> [S] int64
    down = Download(); down.add("tokens", tokens); ...; host = down.fetch()   # host["tokens"] -> list of floats

Naming the parts keeps the packing and the reading in one place each (no offsets to keep in step by hand).
"""

from __future__ import annotations

import numpy as np
import torch

from sparkspec.models.forward_batch import pinned_buffer, pinned_copied


def float_bits(values: list[float]) -> list[int]:
    """Floats shipped inside the int64 upload (read back with `.view(torch.float64)`)."""
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


class Upload:
    """Named lists of host ints laid end to end."""

    def __init__(self) -> None:
        self.parts: dict[str, list[int]] = {}

    def add(self, name: str, values: list[int]) -> None:
        self.parts[name] = list(values)

    def flat(self) -> list[int]:
        return [x for part in self.parts.values() for x in part]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The device copy of `flat()` -> name -> its slice."""
        out, off = {}, 0
        for name, part in self.parts.items():
            out[name] = flat[off : off + len(part)]
            off += len(part)
        return out


class Download:
    """Named device tensors gathered into one device->host copy (as float64: token ids are exact below 2^53)."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[torch.Tensor]] = {}

    def add(self, name: str, *tensors: torch.Tensor) -> None:
        self.pieces[name] = list(tensors)

    def absorb(self, other: Download, tag: str) -> None:
        """Take `other`'s pieces under `tag` (the parts of one step, one copy back: `untag` reads each part's),
        copied now on the device: they may be a graph's outputs, which the next part's replay of the same graph
        (two prompt groups of one padded shape) would overwrite before the copy back."""
        for name, ts in other.pieces.items():
            self.pieces[f"{tag}/{name}"] = [t.to(torch.float64, copy=True) for t in ts]

    def flat(self) -> torch.Tensor | None:
        """Every piece, as float64, end to end on the device (None: nothing added)."""
        parts = [t.double().flatten() for ts in self.pieces.values() for t in ts]
        return torch.cat(parts) if parts else None

    def fetch(self) -> dict[str, list[list[float]]]:
        """The one copy (it waits for the device) -> name -> one host list per tensor added."""
        flat = self.flat()
        return self.unpack(flat.cpu().tolist() if flat is not None else [])

    def start(self) -> PendingFetch:
        """The same copy, started and not waited for: into a pinned host buffer on the device's stream (the
        device runs on; a later step may be launched first). `PendingFetch.wait` -> what `fetch` returns."""
        flat = self.flat()
        if flat is None or flat.device.type == "cpu":
            return PendingFetch(self, flat, None)
        host = pinned_buffer(flat.device, torch.float64, flat.numel())
        host.copy_(flat, non_blocking=True)
        return PendingFetch(self, host, pinned_copied(flat.device, torch.float64))

    def unpack(self, host: list[float]) -> dict[str, list[list[float]]]:
        out, off = {}, 0
        for name, ts in self.pieces.items():
            out[name] = []
            for t in ts:
                out[name].append(host[off : off + t.numel()])
                off += t.numel()
        return out


class PendingFetch:
    """A started `Download` copy: `wait` blocks until the device has written it, then reads it."""

    def __init__(self, down: Download, host: torch.Tensor, done) -> None:
        self.down, self.host, self.done = down, host, done

    def wait(self) -> dict[str, list[list[float]]]:
        if self.done is not None:
            self.done.synchronize()
        return self.down.unpack(self.host.tolist() if self.host is not None else [])


def untag(host: dict[str, list], tag: str) -> dict[str, list]:
    """The pieces `Download.absorb` took under `tag`, by their own names."""
    pre = tag + "/"
    return {name[len(pre) :]: v for name, v in host.items() if name.startswith(pre)}
