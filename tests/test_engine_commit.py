"""The engine's commit and emit: the lean path (`append_tokens`, text decoded only where read) gives exactly what the
general token-by-token path gives (tokens, finish reasons, texts at every step, token sources, counters) on random
token streams with EOS, max_tokens, the context limit and stop strings; `generate`'s finished-only outputs equal
the streamed ones (n > 1 included); `read_step` over numpy equals the old per-element reading."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.engine.packed_step import PackedStep
from sparkspec.engine.scheduler import ScheduledSeq
from sparkspec.engine.sequence import Sequence, SequenceStatus, TokenSource
from sparkspec.engine.step_result import NONFINITE_ERROR, SampledRow, StepResult, logprob_dicts, read_step
from sparkspec.sampling_params import SamplingParams

DEMO = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def eng():
    from sparkspec.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(DEMO)
    return LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8))


def random_requests(eng, rng, num: int, tag: str) -> list[tuple[Sequence, list[list[int]]]]:
    """Requests with random limits and stop strings, each with the token chunks its steps will produce (1..4
    tokens, EOS sprinkled in, multi-byte characters split across tokens)."""
    tok = eng.tokenizer
    text = "The quick brown fox 日本語 jumps over the lazy dog 🎉, said héllo wörld. " * 4
    ids = tok.encode(text)
    eos = sorted(eng.eos_ids)
    out = []
    for n in range(num):
        prompt = ids[: rng.randint(1, 30)]
        stream = ids[rng.randrange(len(ids) // 2):] + [rng.randrange(tok.vocab_size) for _ in range(20)]
        stream = [rng.choice(eos) if rng.random() < 0.03 else t for t in stream]
        stop = [tok.decode(stream[a : a + rng.randint(1, 3)]) for a in rng.sample(range(40), rng.randint(0, 2))]
        params = SamplingParams(max_tokens=rng.randint(1, 50), ignore_eos=rng.random() < 0.3,
                                stop=[s for s in stop if s.strip()])
        seq = Sequence(10_000 + n, prompt, params, request_id=f"{tag}{n}", seed=n)
        seq.status, seq.num_cached_tokens = SequenceStatus.RUNNING, len(prompt) - 1
        chunks, pos = [], 0
        while pos < len(stream):
            k = rng.randint(1, 4)
            chunks.append(stream[pos : pos + k])
            pos += k
        out.append((seq, chunks))
    return out


def register(eng, seqs) -> None:
    """As `add_request` records a request: its id, its detokenizer and its stop strings (`OutputTexts.start`)."""
    for seq in seqs:
        eng.requests[seq.request_id] = seq
        eng.texts.start(seq)


def lean_steps(eng, reqs, emit_unfinished: bool):
    """commit + emit per step, as `LLMEngine.step` calls them -> per step {request_id: (tokens, text, reason)}."""
    eng.emit_unfinished = emit_unfinished
    register(eng, [s for s, _ in reqs])
    steps, t = [], 0
    while True:
        live = [(s, c[t]) for s, c in reqs if not s.is_finished and t < len(c)]
        if not live:
            return steps
        items = [ScheduledSeq(s, 1, len(chunk) - 1) for s, chunk in live]
        drafts = [chunk[1:] for _, chunk in live]  # every draft accepted: the row emits the whole chunk
        rows = {i: SampledRow(len(chunk) - 1, list(chunk), [], None) for i, (_, chunk) in enumerate(live)}
        outs = eng.emit(items, eng.commit(items, drafts, StepResult(rows, False, {}), 0))
        steps.append({o.request_id[1:]: (o.token_ids, o.text, o.finish_reason, o.token_sources) for o in outs})
        t += 1


def oracle_steps(eng, reqs):
    """The general path: `append` token by token with the text extended every step (the pre-lean engine)."""
    eng.emit_unfinished = True
    register(eng, [s for s, _ in reqs])
    steps, t = [], 0
    while True:
        live = [(s, c[t]) for s, c in reqs if not s.is_finished and t < len(c)]
        if not live:
            return steps
        step = {}
        for seq, chunk in live:
            before = len(seq.output_ids)
            eng.append(seq, chunk)
            seq.token_sources += TokenSource.of_step(len(chunk) - 1, len(chunk) - 1)[: len(seq.output_ids) - before]
            step[seq.request_id[1:]] = (list(seq.output_ids), eng.texts.visible(seq), seq.finish_reason,
                                        list(seq.token_sources))
            if seq.is_finished:
                eng.requests.pop(seq.request_id)
        steps.append(step)
        t += 1


@pytest.mark.parametrize("seed", range(4))
def test_lean_commit_equals_the_general_path(eng, seed):
    base = eng.stats.num_generation_tokens
    expected = oracle_steps(eng, random_requests(eng, random.Random(seed), 24, "o"))
    oracle_tokens = eng.stats.num_generation_tokens - base
    reqs = random_requests(eng, random.Random(seed), 24, "s")
    base = eng.stats.num_generation_tokens
    streamed = lean_steps(eng, reqs, emit_unfinished=True)
    assert streamed == expected  # tokens, visible text, finish reason and sources of every request at every step
    assert eng.stats.num_generation_tokens - base == oracle_tokens
    assert {s.finish_reason for s, _ in reqs} >= {"length", "stop"}  # the streams reach both kinds of end
    assert all(s.first_token_time is not None for s, _ in reqs)
    assert not any(s.request_id in eng.requests for s, _ in reqs)  # finished requests are forgotten


@pytest.mark.parametrize("seed", range(4))
def test_finished_only_outputs_equal_the_streamed_ones(eng, seed):
    streamed = lean_steps(eng, random_requests(eng, random.Random(seed), 24, "a"), emit_unfinished=True)
    reqs = random_requests(eng, random.Random(seed), 24, "b")
    offline = lean_steps(eng, reqs, emit_unfinished=False)
    final = {rid: o for step in streamed for rid, o in step.items() if o[2] is not None}
    assert {rid: o for step in offline for rid, o in step.items()} == final  # only finished ones, same content
    assert all(o[2] is not None for step in offline for o in step.values())
    decoded = [s for s, _ in reqs if s.detokenizer is None]  # decoded once at the end, in a batch
    assert decoded and all(not s.params.stop for s in decoded)


def test_the_context_limit_and_a_failed_row(eng):
    tok = eng.tokenizer
    ids = tok.encode("hello there, general kenobi " * 10)
    long = Sequence(1, ids[: MAX_MODEL_LEN - 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="L")
    bad = Sequence(2, ids[:5], SamplingParams(max_tokens=50, ignore_eos=True), request_id="F")
    for seq in (long, bad):
        seq.status, seq.num_cached_tokens = SequenceStatus.RUNNING, seq.num_tokens - 1
    register(eng, [long, bad])
    eng.emit_unfinished = False
    items = [ScheduledSeq(long, 1, 4), ScheduledSeq(bad, 1, 0)]
    rows = {0: SampledRow(4, ids[:5], [], None), 1: SampledRow(0, [ids[9]], [], None, error=NONFINITE_ERROR)}
    outs = eng.emit(items, eng.commit(items, [ids[:4], []], StepResult(rows, False, {}), 0))
    by_id = {o.request_id: o for o in outs}
    assert by_id["L"].finish_reason == "length" and by_id["L"].token_ids == ids[:3]  # 3 positions were left
    assert by_id["L"].text == tok.decode(ids[:3], skip_special_tokens=True)
    assert by_id["F"].finish_reason == "error" and by_id["F"].error == NONFINITE_ERROR and by_id["F"].token_ids == []


def test_generate_groups_equal_streamed_requests(tiny_checkpoint_with_drafters):
    """n > 1 and stop strings through `generate` (finished-only outputs) equal the same requests stepped with
    every output streamed."""
    from sparkspec.loading.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_checkpoint_with_drafters)
    eng = LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(max_num_seqs=4))
    prompts = [ckpt.tokenizer.encode(t, add_special_tokens=True) for t in ("Hello world", "a b a b a b", "def f(x)")]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3),
              SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=["a", "b"]),
              SamplingParams(max_tokens=9, temperature=0.0)]
    outs = eng.generate(prompts, params)
    assert eng.emit_unfinished  # restored
    for prompt, sp, out in zip(prompts, params, outs):
        samples = sp.samples()
        assert len(out.outputs) == len(samples)
        for sample, got in zip(samples, out.outputs):
            seq = eng.add_request(prompt, sample)
            texts = []
            while not seq.is_finished:
                texts += [o.text for o in eng.step() if o.request_id == seq.request_id]
            assert [texts[-1], seq.output_ids, seq.finish_reason] == [got.text, got.token_ids, got.finish_reason]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # streamed text only grows


def read_step_oracle(p, host, q_store):
    """`read_step` before numpy: one int() per element (the oracle)."""
    K1, k, keep = p.K + 1, p.num_drafts, p.keep_drafts
    L = [int(x) for x in host["accepted"][0]]
    toks, finite = host["tokens"][0], host["finite"][0]
    nxt = host["drafts"][0] if "drafts" in host else []
    conf = host["confidences"][0] if "confidences" in host else None
    lp_of = {r: j for j, r in enumerate(p.logprob_rows)}
    rows = {}
    for r, i in enumerate(p.sampling):
        emitted = [int(t) for t in toks[r * K1 : r * K1 + L[r] + 1]]
        lps = None
        if r in lp_of:
            lps = logprob_dicts(emitted, host["sampled"], lp_of[r] * K1, min(p.params[r].logprobs, p.num_top),
                                p.num_top)
        rows[i] = SampledRow(L[r], emitted, [int(t) for t in nxt[r * k : r * k + keep]],
                             conf[r * k : r * k + keep] if conf else None, lps,
                             None if finite[r] else NONFINITE_ERROR)
    return StepResult(rows, q_store is not None and bool(k) and p.mode != "greedy",
                      {i: r for r, i in enumerate(p.sampling)})


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("as_numpy", [False, True])
def test_read_step_equals_the_per_element_reading(seed, as_numpy):
    rng = random.Random(seed)
    num_items, K, k = rng.randint(1, 9), rng.randint(0, 4), rng.choice([0, 3])
    keep = rng.randint(0, k)
    items = [ScheduledSeq(Sequence(i, [1, 2, 3], SamplingParams(logprobs=2 if rng.random() < 0.3 else None)), 1)
             for i in range(num_items)]
    sampling = sorted(rng.sample(range(num_items), rng.randint(1, num_items)))
    S = len(sampling)
    logprob_rows = [r for r, i in enumerate(sampling) if items[i].seq.params.logprobs is not None]
    p = PackedStep(items, [[] for _ in items], sampling=sampling, K=K, mode=rng.choice(["greedy", "sampled"]),
                   num_drafts=k, keep_drafts=keep, logprob_rows=logprob_rows, num_top=3 if logprob_rows else 0)
    host = {"accepted": [[float(rng.randint(0, K)) for _ in range(S)]],
            "tokens": [[float(rng.randrange(50_000)) for _ in range(S * (K + 1))]],
            "finite": [[float(rng.random() < 0.9) for _ in range(S)]]}
    if k:
        host["drafts"] = [[float(rng.randrange(50_000)) for _ in range(S * k)]]
        if rng.random() < 0.5:
            host["confidences"] = [[rng.random() for _ in range(S * k)]]
    if logprob_rows:
        R = len(logprob_rows) * (K + 1)
        host["sampled"] = [[-rng.random() for _ in range(R)], [-rng.random() for _ in range(R * 3)],
                           [float(rng.randrange(100)) for _ in range(R * 3)]]
    expected = read_step_oracle(p, host, "q")
    if as_numpy:  # what a copy back read as one float64 array and sliced gives
        host = {name: [np.asarray(x, dtype=np.float64) for x in parts] for name, parts in host.items()}
    got = read_step(p, host, "q")
    assert got.rows == expected.rows and got.draft_row == expected.draft_row
    assert got.proposed_q == expected.proposed_q
    assert all(type(t) is int for row in got.rows.values() for t in row.token_ids + row.next_drafts)
