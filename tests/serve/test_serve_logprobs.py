"""Log-probabilities (chat ``logprobs``/``top_logprobs``, completions ``logprobs``) and ``n`` > 1
on the CPU server, through the openai client over a real socket: the values are those of the
distribution each token was drawn from (vllm-project/vllm #9453, ollama/ollama #16196), checked
against the engine's own logits recomputed outside the server."""

import math

import openai
import pytest
import torch
from serve_fixtures import cpu_app, cpu_engine

from g4.serve.chat import render_prompt
from g4.serve.engine import LOGPROB_FLOOR, SamplingParams, sample_next, sampling_logprobs
from g4.serve.server import BackgroundServer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "tiny-nvfp4"


def test_sampling_logprobs_are_the_distribution_sample_next_draws_from():
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    assert torch.allclose(sampling_logprobs(logits, SamplingParams(1, temperature=0)), torch.log_softmax(logits, -1))
    p = SamplingParams(1, temperature=0.5)
    assert torch.allclose(sampling_logprobs(logits, p), torch.log_softmax(logits / 0.5, -1), atol=1e-6)
    # top_k: renormalised over the k largest; -inf elsewhere
    p = SamplingParams(1, temperature=0.7, top_k=5)
    lp = sampling_logprobs(logits, p)
    top = torch.topk(logits, 5).indices
    want = torch.full_like(logits, float("-inf"))
    want[top] = torch.log_softmax(logits[top] / 0.7, -1)
    assert torch.equal(torch.isinf(lp), torch.isinf(want)) and torch.allclose(lp[top], want[top], atol=1e-6)
    # top_p and the empirical frequencies of sample_next: the draw follows exp(logprobs)
    p = SamplingParams(1, temperature=1.3, top_p=0.8)
    probs = sampling_logprobs(logits, p).exp()
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5) and int((probs > 0).sum()) < 50
    g = torch.Generator().manual_seed(1)
    draws = torch.bincount(torch.tensor([sample_next(logits, p, g) for _ in range(4000)]), minlength=50).float() / 4000
    assert float((draws - probs).abs().max()) < 0.03
    assert float(draws[probs == 0].sum()) == 0.0


@pytest.fixture(scope="module")
def client():
    with BackgroundServer(cpu_app("nvfp4")) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")


@torch.no_grad()
def reference_logprobs(prompt_ids, ids, params) -> list[torch.Tensor]:
    """The engine's logits at every generated position, recomputed outside the server, turned
    into the sampler's log-probabilities."""
    engine = cpu_engine("nvfp4")
    out, (state, logits) = [], engine.start(list(prompt_ids))
    for t in ids:
        out.append(sampling_logprobs(logits, params))
        state, logits = engine.step(state, t)
    return out


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7),
                                      dict(temperature=1.2, seed=3, extra_body={"top_k": 4, "return_token_ids": True})])
def test_chat_logprobs_match_the_sampler_distribution(client, settings):
    extra = {"return_token_ids": True} | settings.pop("extra_body", {})
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=6, logprobs=True, top_logprobs=6,
                                       extra_body=extra, **settings)
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    content = choice.logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    params = SamplingParams(6, temperature=settings["temperature"], top_p=settings.get("top_p", 1.0),
                            top_k=extra.get("top_k", 0))
    tok = cpu_engine("nvfp4").tokenizer
    for entry, t, lp in zip(content, ids, reference_logprobs(r.model_extra["prompt_token_ids"], ids, params)):
        assert entry.token == tok.decode([t], skip_special_tokens=False) and entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.logprob, max(float(lp[t]), LOGPROB_FLOOR), abs_tol=2e-3)
        assert len(entry.top_logprobs) == 6
        values = [e.logprob for e in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        want = torch.topk(lp, 6).values.clamp(min=LOGPROB_FLOOR).tolist()
        assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(values, want))
        assert entry.logprob <= values[0] + 1e-6 and sum(math.exp(v) for v in values) <= 1 + 1e-4
    if extra.get("top_k"):  # ids outside the top 4 cannot be drawn: reported at the floor
        assert all(e.top_logprobs[-1].logprob == LOGPROB_FLOOR for e in content)
    if settings["temperature"] == 0:  # greedy: the generated id is the most likely one
        assert all(e.token == e.top_logprobs[0].token for e in content)


def test_logprobs_streamed_equal_non_streamed_and_absent_unless_asked(client):
    kw = dict(model=MODEL, messages=FRANCE, max_tokens=6, temperature=0.9, seed=11, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in plain]
    assert client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=3).choices[0].logprobs is None


def test_n_choices_plain_and_streamed(client):
    # The embedded model is sure of its facts; a question it never saw, sampled hot, varies.
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Zq"}], max_tokens=6, temperature=2.0, seed=5, n=3,
              extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert len({tuple(i) for i in ids}) > 1, "sampled choices from one generator should differ"
    assert r.usage.completion_tokens == sum(map(len, ids))
    assert client.chat.completions.create(**kw).choices[2].message.content == r.choices[2].message.content  # seeded
    chunks = list(client.chat.completions.create(stream=True, **kw))
    by_index = {i: "" for i in range(3)}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert by_index == {c.index: c.message.content for c in r.choices}
    assert finishes == {c.index: c.finish_reason for c in r.choices}
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert roles == [0, 1, 2]
    greedy = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, temperature=0, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content == "Paris"


def test_completions_logprobs_and_n(client):
    prompt = render_prompt(cpu_engine("nvfp4").tokenizer, FRANCE)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert all(len(d) <= 3 and max(d.values()) == v for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens).startswith("Paris")
    assert r.choices[1].logprobs.token_logprobs == lp.token_logprobs
