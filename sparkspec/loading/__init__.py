"""Loading: everything between a checkpoint directory (or a random seed) and a model ready to run.

The model definitions (`sparkspec.models`) know nothing of this package; it builds them and fills them.

* `checkpoint`: `load_checkpoint` (config, tokenizer, target weights streamed onto the device, `mtp.*` kept);
* `save`: `write_checkpoint` (official layout, shards + index);
* `names`: transformers' tensor names -> the official ones;
* `plan`: what the safetensors headers say (file, dtype, shape, scale, a rank's cut) — checked before reading;
* `stream`: reading planned tensors one at a time, dequantised or kept quantised where they are placed;
* `state`: installing tensors into a module (`check_tensors`, `assign_tensor`, `load_state`);
* `meta`: models built on the meta device, and what their `__init__` computed moved to the device;
* `quantized`: `Fp8Linear` / `Fp4Linear` and the module surgery that keeps checkpoint weights quantised;
* `drafters`: the DSpark / MTP drafter modules built from a checkpoint's `mtp.*` tensors;
* `random_init`: random tensors by name (`init_rule`), random drafters, `init_checkpoint`;
* `random_model`: random models made on their device, one rank's share at a time;
* `bpe`: the offline byte-level BPE tokenizer trainer (`sparkspec init`, `sparkspec train tokenizer`).

Every user-facing problem is a one-line `CheckpointError` (a `ValueError`) naming the file, tensor or field.
"""


class CheckpointError(ValueError):
    """A user-facing problem with a checkpoint directory (missing file/tensor, wrong shape, dtype)."""
