"""Prefix caching through the engine: the same greedy tokens, and the same drafts accepted token for token, with
and without the cache, for every speculative method, on prompts that share prefixes ending at every kind of
boundary (inside a block, at a block edge, inside and at the edge of a ratio-4 and a ratio-128 entry, inside the
sliding window); eviction under a small KV budget, preemption of requests holding shared blocks, an abort while
others share the request's blocks, n > 1. fp64 random targets keep argmax ties out (as test_spec_engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import drafter_tensors, one_thread, random_target, tiny_config  # noqa: F401

from sparkspec.config import HCA
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["none", "dspark", "mtp", "ngram"]


def engine(model, tensors, method="none", caching=True, **kw) -> LLMEngine:
    kw.setdefault("max_num_batched_tokens", 96)
    kw.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(speculative=method, num_spec_tokens=3 if method != "none" else None,
                       spec_budget="fixed", enable_prefix_caching=caching, **kw)
    return LLMEngine(model, None, cfg, tensors)


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset (ratios 4 and 16, window 16, block 16: G = 16)."""
    cfg = tiny_config()
    return cfg, random_target(cfg), drafter_tensors(cfg, 1)


@pytest.fixture(scope="module")
def tiny128():
    """The tiny preset with a ratio-128 heavy layer (G = lcm(16, 4, 128) = 128)."""
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, compress_rates={**cfg.compress_rates, HCA: 128})
    return cfg, random_target(cfg), drafter_tensors(cfg, 1)


def ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def sharing_prompts(vocab: int, base_len: int, shared: list[int], tail: int = 9) -> list[list[int]]:
    """A base prompt, then one prompt per length in `shared` that repeats its first tokens and diverges, plus
    the base itself again and a strict prefix of it (a hit capped one token short of the end)."""
    base = ids(base_len, 0, vocab)
    out = [base]
    for i, n in enumerate(shared):
        tail_ids = ids(tail, 100 + i, vocab)
        if tail_ids[0] == base[n]:
            tail_ids[0] = 4 + (tail_ids[0] - 3) % (vocab - 4)
        out.append(base[:n] + tail_ids)
    return out + [list(base), base[: base_len - 5]]


def run_turns(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 12):
    """The base first (cached by the time the others come), then the others in one batch -> (outputs in order)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = eng.generate(prompts[:1], params)
    return first + eng.generate(prompts[1:], params)


def signature(outs):
    """What must not change with the cache: the tokens, where each came from (accepted draft j, bonus, target),
    and the request's spec counters."""
    return [(o.token_ids, o.token_sources, o.metrics["spec_drafted"], o.metrics["spec_accepted"],
             o.metrics["spec_accepted_per_position"]) for o in outs]


# tiny (G = 16, block 16, ratios 4/16, window 16): inside a block, a block edge, inside / at the edge of a ratio-4
# entry, the edge of a ratio-16 entry, inside the sliding window of the last hit block
TINY_SHARED = [13, 16, 17, 18, 20, 31, 32, 33, 46, 48, 49, 60]
# ratio 128: around 128 and 256 (entry edges), inside a 128-entry, a block edge inside it, ratio-4 edges
TINY128_SHARED = [100, 127, 128, 129, 130, 132, 144, 200, 255, 256, 257, 262]


@pytest.mark.parametrize("method", METHODS)
def test_same_tokens_and_acceptance_with_and_without_the_cache(tiny, method):
    cfg, model, tensors = tiny
    prompts = sharing_prompts(cfg.vocab_size, 64, TINY_SHARED)
    off = run_turns(engine(model, tensors, method, caching=False), prompts)
    eng = engine(model, tensors, method)
    on = run_turns(eng, prompts)
    assert signature(on) == signature(off)
    # every hit is the shared length in whole blocks (G = 16), capped one token before the prompt's end
    expected = sum(min(n, len(p) - 1) // 16 * 16 for n, p in zip(TINY_SHARED, prompts[1:]))
    if method == "mtp":  # the row of h - 1 reads the token at h: a hit needs the token after it matched too
        expected = sum(min(n - 1, len(p) - 1) // 16 * 16 for n, p in zip(TINY_SHARED, prompts[1:]))
    expected += 48 + 48  # the base again (63 of 64: 48) and its 59-token prefix (58: 48)
    assert eng.stats.num_prefix_cache_hits == expected
    assert eng.stats.num_prefix_cache_queries == sum(map(len, prompts))
    if method in ("dspark", "mtp"):
        assert eng.stats.num_drafted > 0


@pytest.mark.parametrize("method", METHODS)
def test_ratio_128_entries_same_tokens_with_and_without_the_cache(tiny128, method):
    cfg, model, tensors = tiny128
    assert engine(model, tensors, caching=False).scheduler.block_manager.granularity == 128
    prompts = sharing_prompts(cfg.vocab_size, 270, TINY128_SHARED)
    off = run_turns(engine(model, tensors, method, caching=False, max_num_batched_tokens=160), prompts, 8)
    eng = engine(model, tensors, method, max_num_batched_tokens=160)
    on = run_turns(eng, prompts, 8)
    assert signature(on) == signature(off)
    last = 1 if method == "mtp" else 0
    expected = sum(min(n - last, len(p) - 1) // 128 * 128 for n, p in zip(TINY128_SHARED, prompts[1:])) + 256 + 256
    assert eng.stats.num_prefix_cache_hits == expected


def block_rows(eng: LLMEngine, blocks: list[int]) -> list[torch.Tensor]:
    """The rows of `blocks` in every pool of the target and the drafter (a copy)."""
    pools = [t for layer in eng.runner.cache.layers for t in layer.values()]
    if eng.spec is not None:
        pools += list(getattr(eng.spec.proposer, "pools", []))
    n = eng.scheduler.block_manager.num_blocks + 1  # + the scratch block; then the trash row
    out = []
    for t in pools:
        rpb = (t.shape[0] - 1) // n
        out.append(torch.cat([t[b * rpb : (b + 1) * rpb] for b in blocks]).clone())
    return out


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("granularity", [None, 16])
def test_shared_blocks_are_never_written_again(tiny128, method, granularity):
    """Every pool row of a cached block is bitwise unchanged while other requests take hits on it and run past
    it. With G forced down to the block size (a hit inside a 128-entry) the rule breaks: a request taking a hit
    at 144 closes entry 1 (at 255) into the block of position 128, which it shares."""
    cfg, model, tensors = tiny128
    base = ids(300, 0, cfg.vocab_size)
    eng = engine(model, tensors, method, max_num_batched_tokens=160)
    bm = eng.scheduler.block_manager
    if granularity is not None:
        bm.granularity = granularity
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.generate([base], params)
    cached = sorted(bm.block_hashes)
    assert len(cached) == (256 if granularity is None else 304) // 16
    before = block_rows(eng, cached)
    # (145 shared: MTP's hit needs the token after it to match too)
    eng.generate([base[:145] + ids(129, 7, cfg.vocab_size), base[:290] + ids(10, 8, cfg.vocab_size)], params)
    after = block_rows(eng, cached)
    same = all(torch.equal(x, y) for x, y in zip(before, after))
    assert same == (granularity is None)


def test_eviction_under_a_small_kv_budget(tiny):
    cfg, model, tensors = tiny
    block_bytes = engine(model, tensors).kv_plan.bytes_per_block
    prompts = [ids(64, s, cfg.vocab_size) for s in range(6)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = [o.token_ids for o in engine(model, tensors, caching=False).generate(prompts, params)]
    eng = engine(model, tensors, kv_cache_memory=12 * block_bytes, max_num_seqs=2)  # ~2.5 prompts' blocks
    bm = eng.scheduler.block_manager
    for p, ref in zip(prompts, reference):  # one at a time: each evicts the oldest cached prompts
        assert eng.generate([p], params)[0].token_ids == ref
    assert eng.stats.num_prefix_cache_hits == 0
    last = eng.generate([prompts[-1]], params)[0]  # the latest prompt is still cached
    assert last.token_ids == reference[-1] and eng.stats.num_prefix_cache_hits == 48
    first = eng.generate([prompts[0]], params)[0]  # the first one was evicted
    assert first.token_ids == reference[0] and eng.stats.num_prefix_cache_hits == 48
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
def test_preemption_of_requests_holding_shared_blocks(tiny, method):
    cfg, model, tensors = tiny
    system = ids(48, 3, cfg.vocab_size)
    prompts = [system + ids(5 + i, 40 + i, cfg.vocab_size) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in engine(model, tensors, method, caching=False).generate(prompts, params)]
    block_bytes = engine(model, tensors, method).kv_plan.bytes_per_block
    eng = engine(model, tensors, method, kv_cache_memory=16 * block_bytes)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0 and eng.stats.num_prefix_cache_hits > 0
    assert [o.token_ids for o in outs] == reference
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_abort_of_a_request_whose_blocks_others_share(tiny):
    cfg, model, tensors = tiny
    system = ids(40, 5, cfg.vocab_size)
    a, b = system + ids(6, 50, cfg.vocab_size), system + ids(7, 51, cfg.vocab_size)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref_b = engine(model, tensors, caching=False).generate([b], params)[0].token_ids
    eng = engine(model, tensors, max_num_batched_tokens=16)
    eng.add_request(a, params, "a")
    while eng.requests["a"].num_cached_tokens < 32:
        eng.step()
    eng.add_request(b, params, "b")
    eng.step()
    bm = eng.scheduler.block_manager
    shared = eng.requests["b"].block_ids[:2]
    assert shared == eng.requests["a"].block_ids[:2] and all(bm.ref_counts[x] == 2 for x in shared)
    eng.abort_request("a")
    assert all(bm.ref_counts[x] == 1 for x in shared)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["b"].token_ids == ref_b
    assert bm.num_free_blocks == bm.num_blocks


def test_samples_of_one_request_share_the_prompt(tiny):
    cfg, model, tensors = tiny
    prompt = ids(70, 9, cfg.vocab_size)
    params = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    off = engine(model, tensors, caching=False).generate([prompt], params)[0]
    eng = engine(model, tensors)
    on = eng.generate([prompt], params)[0]
    assert [o.token_ids for o in on.outputs] == [o.token_ids for o in off.outputs]
    assert eng.stats.num_prefix_cache_hits == 2 * 64  # samples 1 and 2: 64 of their 70 tokens
