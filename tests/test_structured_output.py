"""Structured output (`response_format` / `SamplingParams.structured`, through xgrammar): on the demo pair (trained
target + DSpark + MTP, byte-level BPE 4096) every method returns JSON that validates, greedy tokens are identical
across methods, the sampled distribution with speculation equals the one without, a plain request in the same
batch is unaffected; then the server with the real `openai` client."""

from __future__ import annotations

import collections
import json
import re

import openai
import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from sparkspec.engine.config import EngineConfig  # noqa: E402
from sparkspec.engine.grammar import GrammarBackend, parse_response_format  # noqa: E402
from sparkspec.engine.llm_engine import LLMEngine  # noqa: E402
from sparkspec.ops.sampling import apply_token_bitmask, mask_draft_probs  # noqa: E402
from sparkspec.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

METHODS = ["none", "dspark", "mtp", "ngram"]
SCHEMA = {  # a string, an integer, an enum and a nested array (bounded, so a weak model finishes)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
FMT = StructuredOutput("json_schema", SCHEMA)
PROMPTS = ["<|User|>Describe a person as JSON.<|Assistant|>", "<|User|>How do I sort a list in Python?<|Assistant|>",
           "<|User|>Write a story about a cat.<|Assistant|>", "<|User|>What is 12 + 30?<|Assistant|>"]


@pytest.fixture(scope="module")
def demo():
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL

    return load_checkpoint(DEFAULT_MODEL, dtype="float32")


def make_engine(demo, method: str, **kw) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=16, speculative=method, num_spec_tokens=4 if method != "none" else None,
                       spec_budget="fixed", **kw)
    return LLMEngine(demo.model, demo.tokenizer, cfg, demo.drafter_tensors)


@pytest.fixture(scope="module")
def engines(demo):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MTP: k > its layers
        return {m: make_engine(demo, m) for m in METHODS}


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


# ---- units ----
def test_bitmask_masks_logits():
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0], mask[1, 1] = 0b101, 1 << 7  # row 0: tokens 0, 2; row 1: token 39
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [39]
    assert torch.isfinite(apply_token_bitmask(logits, torch.full((2, 2), -1, dtype=torch.int32))).all()


def test_mask_draft_probs_renormalises_over_allowed_tokens():
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[0b0110], [0b0011]], dtype=torch.int32)  # row 0: tokens 1, 2; row 1: tokens 0, 1
    out = mask_draft_probs(q, mask)
    assert torch.allclose(out[0], torch.tensor([0.0, 0.5, 0.5, 0.0]))
    assert torch.equal(out[1], q[1])  # no allowed mass: q kept (its draft is refused and rejected)


def test_verify_masks_cut_or_keep_refused_drafts(demo):
    backend = GrammarBackend(demo.tokenizer, demo.model.cfg.vocab_size, [1])
    g = backend.matcher(StructuredOutput("json_schema", {"enum": ["red", "green"]}))
    tok = demo.tokenizer
    good = tok.encode('"red"', add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    drafts, masks, _ = g.verify_masks(good + bad + good, cut_refused=True)
    assert drafts == good and masks.shape[0] == len(good) + 1
    calls = []
    redrawn, _, n = g.verify_masks(good + bad, cut_refused=False, redraw=lambda i, m: calls.append(i) or 1)
    assert calls == [len(good)] and n == 1 and redrawn == good + [1]  # the stop token is allowed there
    kept, masks, n = g.verify_masks(good + bad + good, cut_refused=False, redraw=lambda i, m: None)
    assert n == 0 and kept == good + bad + good and masks.shape[0] == len(kept) + 1
    assert (masks[len(good) + 1 :] == -1).all()  # rows past the refused draft: unreachable, all allowed
    allowed = apply_token_bitmask(torch.zeros(len(kept) + 1, demo.model.cfg.vocab_size), masks)
    assert torch.isfinite(allowed[len(good), 1])  # after '"red"' the stop token is allowed
    assert not torch.isfinite(allowed[len(good), bad[0]])
    for i, t in enumerate(good):  # the matcher was rolled back: it accepts the same tokens again
        assert torch.isfinite(allowed[i, t]) and g.accept(t)
    assert g.accept(1) and g.is_terminated


@pytest.mark.parametrize("value,field", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_object", "extra": 1}, "response_format.extra"),
    ("json", "response_format"),
])
def test_bad_response_format_names_the_field(value, field):
    with pytest.raises(ValueError, match=f"^{field}[ :]"):
        parse_response_format(value)


def test_invalid_schema_is_refused_at_admission(engines):
    bad = SamplingParams(structured=StructuredOutput("json_schema", {"type": 5}))
    with pytest.raises(ValueError, match="^response_format.json_schema.schema"):
        engines["none"].check_request([0, 4, 5], bad)


# ---- the demo under every method ----
@pytest.fixture(scope="module")
def outputs(engines):
    """method -> temperature -> outputs of PROMPTS (seeded)."""
    out = {}
    for m, eng in engines.items():
        out[m] = {T: eng.generate(PROMPTS, SamplingParams(max_tokens=160, temperature=T, seed=7, structured=FMT))
                  for T in (0.0, 1.0)}
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(outputs, method, temperature):
    outs = outputs[method][temperature]
    assert [o.finish_reason for o in outs] == ["stop"] * len(PROMPTS)
    assert all(valid(o.text) for o in outs), [o.text for o in outs]


def test_greedy_tokens_identical_across_methods(outputs):
    plain = [o.token_ids for o in outputs["none"][0.0]]
    for m in METHODS[1:]:
        assert [o.token_ids for o in outputs[m][0.0]] == plain, m


def test_drafts_were_verified(outputs):
    for m in METHODS[1:]:
        assert sum(o.metrics["spec_accepted"] for T in (0.0, 1.0) for o in outputs[m][T]) > 0, m


def test_sampled_distribution_with_speculation_equals_without(engines):
    """Two-sample chi-square on the whole output of a small enum (words with shared prefixes, so drafts cross the
    choice) at T = 1: speculation (with drafts the grammar refuses among them) must not move the distribution.
    Seeds are fixed, so the test is deterministic; the bound (chi2 < 40 at <= 7 df, p ~ 1e-6) leaves room."""
    fmt = StructuredOutput("json_schema", {"enum": ["red", "reddish", "green", "greenish", "blue", "bluish"]})
    prompt = "<|User|>Pick a colour.<|Assistant|>"
    N = 320
    counts = {}
    for m in METHODS:
        outs = engines[m].generate([prompt] * N, [SamplingParams(max_tokens=16, temperature=1.0, seed=1000 + i,
                                                                 structured=fmt) for i in range(N)])
        assert all(o.finish_reason == "stop" for o in outs)
        counts[m] = collections.Counter(o.text for o in outs)
    base = counts["none"]
    assert len(base) >= 3  # the test sees a real choice
    assert engines["dspark"].stats.num_grammar_redrawn + engines["mtp"].stats.num_grammar_redrawn > 0
    for m in METHODS[1:]:
        keys = set(base) | set(counts[m])
        chi2 = sum((base[k] - counts[m][k]) ** 2 / (base[k] + counts[m][k]) for k in keys)
        assert chi2 < 40, (m, dict(base), dict(counts[m]))


def test_json_object_mode(engines):
    fmt = StructuredOutput("json_object")
    for m in ("none", "dspark"):
        outs = engines[m].generate(PROMPTS, SamplingParams(max_tokens=200, temperature=0.0, structured=fmt))
        for o in outs:
            if o.finish_reason == "stop":
                json.loads(o.text)
            else:  # cut by max_tokens: still a prefix the grammar accepts
                backend = engines[m].grammars()
                g = backend.matcher(fmt)
                assert all(g.accept(t) for t in o.token_ids)
        assert any(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("method", ["none", "dspark", "ngram"])
def test_plain_request_in_a_structured_batch_is_unaffected(engines, method):
    eng = engines[method]
    for T in (0.0, 1.0):
        plain = SamplingParams(max_tokens=40, temperature=T, seed=3, ignore_eos=True)
        alone = eng.generate([PROMPTS[1]], plain)[0].token_ids
        structured = [SamplingParams(max_tokens=60, temperature=T, seed=s, structured=FMT) for s in (3, 4)]
        mixed = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]],
                             [structured[0], plain, structured[1], plain])
        assert mixed[1].token_ids == alone and mixed[3].token_ids == alone


# ---- the server, with the real openai client ----
@pytest.fixture(scope="module")
def client(demo):
    from tests.test_server import Server

    eng = make_engine(demo, "dspark")
    with Server(eng, model="demo") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_server_chat_json_schema(client, stream):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    for T in (0.0, 1.0):
        r = client.chat.completions.create(model="demo", messages=msgs, response_format=RF, max_tokens=160,
                                           temperature=T, seed=5, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        assert valid(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_server_completion_json_object(client, stream):
    r = client.completions.create(model="demo", prompt="<|User|>A JSON list of numbers.<|Assistant|>",
                                  max_tokens=200, temperature=0.0, extra_body={"response_format": RF}, stream=stream)
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert valid(text), text
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0.0)
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("rf,field", [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
])
def test_server_bad_response_format_is_400(client, rf, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], response_format=rf)
    assert e.value.body["param"] == field, e.value.body
    assert e.value.body["message"].startswith(field)


def test_redraw_from_masked_q_is_lossless():
    """The draft-side rule on the rejection sampler alone: d ~ q, a refused d redrawn from q_m, verified against q_m
    with the masked target -> the emitted tokens follow the masked target p_m exactly (chi-square over 60k rows,
    fixed seeds); verifying against the unmasked q instead is visibly biased (the test has power)."""
    from sparkspec.ops.sampling import SamplingTensors
    from sparkspec.spec_decode.rejection import RejectionSampler

    R, V = 60_000, 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g).expand(R, 2, V).clone()  # [R, K+1 = 2, V]
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)  # mass on refused tokens too
    mask = torch.tensor([0b001111], dtype=torch.int32).expand(R, 2, 1)  # tokens 0..3 allowed
    q_m = mask_draft_probs(q.expand(R, 1, V), mask[:, :1])
    d = torch.multinomial(q.expand(R, V), 1, generator=g)  # [R, 1]
    redraw = torch.multinomial(q_m[:, 0], 1, generator=g)
    d = torch.where(d >= 4, redraw, d)
    st = SamplingTensors(torch.ones(R), torch.zeros(R, dtype=torch.long), torch.ones(R), torch.arange(R), False,
                         False, False)
    masked = apply_token_bitmask(logits, mask)
    p_m = torch.softmax(masked[0, 0], -1)
    positions = torch.zeros(R, dtype=torch.long)

    def chi2(q_verify):
        out, _ = RejectionSampler()(masked, d, q_verify, st, positions)
        counts = torch.bincount(out[:, 0], minlength=V).double()
        expected = p_m.double() * R
        assert counts[4:].sum() == 0  # never a token the grammar refuses
        return float(((counts[:4] - expected[:4]) ** 2 / expected[:4]).sum())

    assert chi2(q_m) < 30  # 3 df: p ~ 1e-6
    assert chi2(q.expand(R, 1, V).clone()) > 100  # the unmasked q: biased


# ---- grammars other than JSON: regex, EBNF, choice (vLLM's `structured_outputs`) ----
OTHER = {"regex": StructuredOutput("regex", r"(yes|no), [0-9]{2,3}!"),
         "grammar": StructuredOutput("grammar", 'root ::= "A" [b-d] [b-d]? "." | "Z"'),
         "choice": StructuredOutput("choice", ["red", "green", "blue"])}
OTHER_OK = {"regex": re.compile(r"(yes|no), [0-9]{2,3}!").fullmatch,
            "grammar": re.compile(r"A[b-d]{1,2}\.|Z").fullmatch,
            "choice": lambda text: text in ("red", "green", "blue")}


@pytest.mark.parametrize("kind", sorted(OTHER))
@pytest.mark.parametrize("method", ["none", "dspark", "ngram"])
def test_other_grammars_hold_under_speculation(engines, kind, method):
    for T in (0.0, 1.0):
        outs = engines[method].generate(PROMPTS, SamplingParams(max_tokens=40, temperature=T, seed=9,
                                                                structured=OTHER[kind]))
        for o in outs:
            assert o.finish_reason == "stop" and OTHER_OK[kind](o.text), (kind, method, T, o.text)


def test_server_structured_outputs_field(client):
    msgs = [{"role": "user", "content": "Pick a colour."}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=20, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.completions.create(model="demo", prompt="Number:", max_tokens=20, temperature=0.0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)


@pytest.mark.parametrize("so,field", [
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"yaml": "x"}, "structured_outputs.yaml"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "("}, "structured_outputs.regex"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar"),
])
def test_server_bad_structured_outputs_is_400(client, so, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"structured_outputs": so})
    assert e.value.body["param"] == field, e.value.body


def test_masks_are_made_after_the_forward_is_launched(engines):
    """The verify masks (the costly host part) are made when the runner reads them, after it launched the step's
    forward (on a GPU the host makes them while the device runs); the tokens are those of the eager masks."""
    from sparkspec.engine import grammar as grammar_module

    eng = engines["dspark"]
    events, forward, step = [], eng.runner.forward, eng.step
    real_row_masks = grammar_module.RequestGrammar.row_masks

    def traced_step():
        events.append("step")
        return step()

    def traced_forward(p, *args):
        events.append("forward")
        return forward(p, *args)

    def traced_row_masks(self, drafts):
        events.append("masks")
        return real_row_masks(self, drafts)

    params = SamplingParams(max_tokens=30, temperature=0.0, structured=FMT)
    want = eng.generate(PROMPTS[:2], params)
    eng.runner.forward, eng.step = traced_forward, traced_step
    grammar_module.RequestGrammar.row_masks = traced_row_masks
    try:
        got = eng.generate(PROMPTS[:2], params)
    finally:
        eng.runner.forward = forward
        del eng.step  # the class's method again
        grammar_module.RequestGrammar.row_masks = real_row_masks
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    steps = " ".join(events).split("step")[1:]  # each step's events, in order
    assert sum("masks" in s for s in steps) >= 10  # structured steps made masks ...
    for s in steps:  # ... always after that step's forward
        if "masks" in s:
            assert s.index("forward") < s.index("masks"), s


def test_lazy_masks_subset():
    from sparkspec.engine.grammar import LazyMasks

    calls = []
    lazy = LazyMasks(lambda: calls.append(1) or {2: "a", 5: "b"}, [2, 5])
    part = lazy.subset([5, 7, 2])
    assert list(part) == [0, 2] and not calls and not lazy.is_made
    assert part[0] == "b" and part[2] == "a" and lazy[2] == "a" and calls == [1]  # made once, shared
    assert lazy.subset([1, 3]) is None
    with pytest.raises(KeyError):
        part[1]
