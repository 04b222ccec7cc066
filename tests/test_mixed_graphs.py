"""Mixed graphs (`cuda_graphs.py`): decode / verify rows and up to `MIXED_PROMPTS` joining prompts replay one graph,
the prompts back to back after the decode rows. On CPU the static steps run eagerly on the same packed inputs
(`use_graphs(eager=True)`), so the padding, the ragged prompt slots and the order of the sampling requests are
checked against the dynamic engine, which runs every step as one unpadded forward."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, static_step_engine, tiny_setup  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.cuda_graphs import MIXED_PROMPTS, GraphKey, prompt_slot_rows, request_rows
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(model, tensors, method: str, static: bool, overlap: bool = False, **kw) -> LLMEngine:
    return static_step_engine(model, tensors, method, static, max_num_seqs=8, async_scheduling=overlap, **kw)


def test_prompt_slots_and_keys():
    key = GraphKey(4, 1, "greedy", 0, 0, 64, MIXED_PROMPTS)
    assert prompt_slot_rows(key, [10, 7]) == [10, 7, 1, 46]  # dummies: a row each, the last one the rest
    assert prompt_slot_rows(key, [10, 7, 5, 9]) == [10, 7, 5, 42]  # full: the last chunk's rows past it are padding
    assert request_rows(key, [10, 7]) == [1, 1, 1, 1, 10, 7, 1, 46]
    assert request_rows(GraphKey(2, 4, "greedy", 3, 3)) == [4, 4]  # not mixed: R·[q]

    cfg, model, tensors = tiny_setup()
    graphs = make_engine(model, tensors, "none", True).runner.graphs
    assert graphs.mixed_rows == (64, 256, 512)  # the default budget's longest prefill (1,024 -> 512), /2, /8
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [130]) == GraphKey(4, 1, "greedy", 0, 0, 256, MIXED_PROMPTS)
    assert graphs.mixed_key_for(3, 1, "sample", 0, [20, 30]).prompt_rows == 64
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [61]).prompt_rows == 64  # 61 + three empty slots' rows
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [62]).prompt_rows == 256
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [250, 260]).prompt_rows == 512
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [9] * (MIXED_PROMPTS + 1)) is None  # more prompts than slots
    assert graphs.mixed_key_for(3, 1, "greedy", 0, [300, 300]) is None  # more rows than the largest graph
    assert graphs.mixed_key_for(0, 1, "greedy", 0, [30]) is None  # no decode row: a prefill graph's step
    assert graphs.width_for(graphs.mixed_key_for(3, 1, "greedy", 0, [30])) == graphs.prefill_width


def join_in_bursts(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Two requests decode; then four join in one step, later one more, then the rest as others end."""
    done, added = {}, 0

    def add(n: int) -> None:
        nonlocal added
        for _ in range(n):
            if added < len(prompts):
                eng.add_request(prompts[added], params[added], request_id=str(added))
                added += 1

    add(2)
    step = 0
    while eng.has_unfinished() or added < len(prompts):
        step += 1
        if step == 3:
            add(4)  # a burst: four prompts beside the decode rows (every prompt slot taken)
        elif step == 6:
            add(1)
        elif step > 6 and len(eng.requests) < 4:
            add(1)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.mark.parametrize("method", ["none", "dspark"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("overlap", [False, True])
def test_bursts_of_joining_prompts_equal_the_dynamic_engine(method, temperature, overlap):
    """Requests joining in bursts (four at once: the last slot's padding rows written past a real prompt's end),
    one whose prompt shares cached blocks with an earlier one (its chunk starts past 0), greedy and seeded
    sampling, drafting (verify rows beside prompts that propose their first drafts) and steps launched ahead (the
    pending tokens of the decode rows filled on the device): the tokens of the dynamic engine, and the burst ran
    as mixed graphs."""
    if method == "dspark" and overlap:
        pytest.skip("a drafting engine launches ahead only its plain steps (the fixed budget drafts on every one)")
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [20, 5, 9, 14, 7, 11, 6, 10, 8], seed=21)
    prompts[6] = prompts[0][:16] + prompts[6]  # a cached block of request 0 (block size 16), then its own tokens
    params = [SamplingParams(max_tokens=5 + (3 * i) % 7, temperature=temperature, seed=60 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = join_in_bursts(make_engine(model, tensors, method, False), prompts, params)
    eng = make_engine(model, tensors, method, True, overlap=overlap)
    got = join_in_bursts(eng, prompts, params)
    assert got == want
    assert eng.runner.num_mixed_steps >= 3
    assert eng.stats.num_prefix_cache_hits > 0  # request 6 joined on a cached block
    assert eng.scheduler.block_manager.usage == 0 and not eng.has_unfinished()


def test_steps_a_mixed_graph_does_not_hold_run_in_parts():
    """More prompts than slots, or a chunk that samples nothing, split as before (tokens unchanged)."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [6, 40, 5, 7, 9, 8, 6, 30], seed=5)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * len(prompts)

    def run(eng: LLMEngine) -> list[list[int]]:
        eng.add_request(prompts[0], params[0], request_id="0")
        eng.step()
        eng.step()
        for i in range(1, len(prompts)):  # seven at once: more than the slots, a long one chunked (budget 32)
            eng.add_request(prompts[i], params[i], request_id=str(i))
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
        return [out[str(i)] for i in range(len(prompts))]

    want = run(make_engine(model, tensors, "none", False, max_num_batched_tokens=32))
    eng = make_engine(model, tensors, "none", True, max_num_batched_tokens=32)
    splits, split = [], eng.runner.execute_split
    eng.runner.execute_split = lambda *a, **kw: splits.append(1) or split(*a, **kw)
    assert run(eng) == want
    assert splits, "a step the mixed graph cannot hold ran in parts"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["none", "dspark"])
@pytest.mark.parametrize("overlap", [False, True])
def test_captured_mixed_graphs_equal_eager(method, overlap):
    """On a GPU the mixed graphs are captured at start-up and replayed (fp32: the tokens of the dynamic eager
    engine), in turn and launched ahead."""
    if method == "dspark" and overlap:
        pytest.skip("a drafting engine launches ahead only its plain steps (the fixed budget drafts on every one)")
    cfg, model, tensors = tiny_setup()
    model = copy.deepcopy(model).to("cuda", torch.float32).keep_fp32()
    prompts = mixed_prompts(cfg.vocab_size, [20, 5, 9, 14, 7, 11, 6, 10, 8], seed=21)
    params = [SamplingParams(max_tokens=5 + (3 * i) % 7, ignore_eos=True) for i in range(len(prompts))]

    def build(eager: bool) -> LLMEngine:
        c = EngineConfig(max_num_seqs=8, speculative=method, num_spec_tokens=3 if method != "none" else None,
                         spec_budget="fixed", enforce_eager=eager, async_scheduling=overlap and not eager,
                         max_num_batched_tokens=64)
        return LLMEngine(model, None, c, tensors)

    want = join_in_bursts(build(True), prompts, params)
    eng = build(False)
    assert join_in_bursts(eng, prompts, params) == want
    assert eng.runner.num_mixed_steps >= 3
