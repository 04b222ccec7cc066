"""The number of torch ops in one decode step does not grow with the batch size (no per-request loop or host
sync in the model, the sampler or the drafter): counted with a TorchDispatchMode over one engine step."""

from __future__ import annotations

from collections import Counter

import pytest
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(method: str, batch: int, temperature: float) -> Counter:
    _, model, tensors = tiny_setup()
    eng = LLMEngine(model, None, EngineConfig(max_num_seqs=64, speculative=method, num_spec_tokens=3,
                                              spec_budget="fixed"), tensors)
    params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True)
    for p in mixed_prompts(model.cfg.vocab_size, [9 + i % 13 for i in range(batch)], seed=batch):
        eng.add_request(p, params)
    while any(not s.output_ids for s in eng.requests.values()):
        eng.step()  # prefill
    eng.step()  # the first verify step: drafts exist from here on
    counter = OpCounter()
    with counter:
        eng.step()
    return counter.ops


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ops_per_decode_step_do_not_grow_with_the_batch(method, temperature):
    one, many = decode_step_ops(method, 1, temperature), decode_step_ops(method, 32, temperature)
    ratio = sum(many.values()) / sum(one.values())
    assert ratio <= 1.2, f"{sum(one.values())} ops at batch 1, {sum(many.values())} at batch 32"
    assert not [op for op in many if op.startswith(SYNC_OPS)], "a host sync inside the step"
