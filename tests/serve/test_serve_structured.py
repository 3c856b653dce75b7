"""Structured output on the CPU server (``response_format`` ``json_object`` / ``json_schema``
through llguidance), via the openai client over a real socket: the content is valid JSON of the
schema on the embedded model, streamed = non-streamed, forbidden ids are at the logprob floor,
the reasoning channel stays free, bad formats are 400s."""

import json

import openai
import pytest
from serve_fixtures import ScriptedEngine, cpu_app
from transformers import AutoTokenizer

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.serve.engine import LOGPROB_FLOOR
from g4.serve.server import BackgroundServer, create_app

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "tiny-nvfp4"
CAPITAL = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                            "population_millions": {"type": "integer", "minimum": 0,
                                                                    "maximum": 99}},
           "required": ["capital", "population_millions"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    with BackgroundServer(cpu_app("nvfp4")) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")


def schema_format(schema=CAPITAL):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_content_is_valid_and_streamed_equals_plain(client):
    kw = dict(model=MODEL, messages=FRANCE, temperature=0, max_tokens=40, response_format=schema_format())
    r = client.chat.completions.create(**kw)
    value = json.loads(r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    assert set(value) == {"capital", "population_millions"} and value["capital"] in ("Paris", "Rome", "Tokyo")
    assert isinstance(value["population_millions"], int) and 0 <= value["population_millions"] <= 99
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    # sampled too: every draw is valid
    for seed in range(3):
        s = client.chat.completions.create(**(kw | {"temperature": 1.5, "seed": seed}))
        assert json.loads(s.choices[0].message.content)["capital"] in ("Paris", "Rome", "Tokyo")


def test_json_object_and_the_constrained_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3, logprobs=True,
                                       top_logprobs=3, response_format={"type": "json_object"})
    first = r.choices[0].logprobs.content[0]
    assert first.token.lstrip().startswith("{")  # an object opens (whitespace may come first)
    assert first.top_logprobs[-1].logprob == LOGPROB_FLOOR  # "Paris" and the rest are forbidden
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    assert plain.choices[0].message.content == "Paris"  # without response_format: the model's answer


@pytest.mark.parametrize("fmt, message", [
    ({"type": "xml"}, "not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}, "must be a JSON object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "cannot be used"),
])
def test_bad_response_formats_are_400(client, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=3, response_format=fmt)
    assert message in str(e.value) and e.value.body["param"] == "response_format"


def test_the_reasoning_channel_is_not_constrained():
    """A reply that opens Gemma 4's thought channel reasons freely; the JSON starts after it."""
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    script = [100] + enc("thought\nno JSON here, just words") + [101] + enc('{"capital": "Paris", '
                                                                            '"population_millions": 2}') + [106]
    app = create_app(ScriptedEngine(tok, script), served_model_name="scripted")
    with BackgroundServer(app) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
        r = c.chat.completions.create(model="scripted", messages=FRANCE, temperature=0, max_tokens=60,
                                      response_format=schema_format(),
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        off = c.chat.completions.create(model="scripted", messages=FRANCE, temperature=0, max_tokens=60,
                                        response_format=schema_format())
    assert json.loads(off.choices[0].message.content)["capital"] in ("Paris", "Rome", "Tokyo")  # no channel
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "no JSON here, just words"
    assert json.loads(msg.content) == {"capital": "Paris", "population_millions": 2}
