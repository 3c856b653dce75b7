"""Reply parsing on token ids (P13), stop strings, chat-template rendering, sampling."""

import random

import pytest
import torch
from transformers import AutoTokenizer

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.serve.chat import ChatError, ControlIds, Delta, ReplyParser, StopMatcher, control_text_in, render_prompt
from g4.serve.engine import SamplingParams, sample_next

# A template in the style of the 26B-A4B release (spec §5.2): <|think|> in a system turn when
# thinking is on; an empty, closed thought block after the generation prompt when it is off.
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{% if enable_thinking is defined and enable_thinking %}<|turn>system\n<|think|><turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n"
    "{% if not (enable_thinking is defined and enable_thinking) %}<|channel>thought\n<channel|>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)


@pytest.fixture(scope="module")
def ctl(tok):
    return ControlIds.from_tokenizer(tok)


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def parse(tok, ctl, ids, prompt_ids=None, chunks=None) -> Delta:
    """Feed ``ids`` in the given chunk sizes (None: all at once) and finish."""
    p = ReplyParser(tok, ctl, prompt_ids)
    out = Delta()
    if chunks is None:
        out += p.feed(ids)
    else:
        i = 0
        for n in chunks:
            out += p.feed(ids[i:i + n])
            i += n
        out += p.feed(ids[i:])
    out += p.finish()
    return out


def test_control_ids_come_from_the_tokenizer(tok, ctl):
    assert (ctl.channel_open, ctl.channel_close, ctl.turn_end, ctl.think) == tuple(
        tok.convert_tokens_to_ids(t) for t in ("<|channel>", "<channel|>", "<turn|>", "<|think|>"))
    assert (ctl.channel_open, ctl.channel_close, ctl.turn_end, ctl.think, ctl.turn_open) == (
        100, 101, 106, 98, 105)  # Gemma 4 ids
    assert {1, 2, 105, 50}.issubset(ctl.special)
    assert not ctl.special & set(text_ids(tok, "Paris is the capital of France."))


def test_thought_block_goes_to_reasoning(tok, ctl):
    ids = ([ctl.channel_open] + text_ids(tok, "thought\nThe capital of France is Paris.") + [ctl.channel_close]
           + text_ids(tok, "Paris") + [ctl.turn_end])
    whole = parse(tok, ctl, ids)
    assert whole.reasoning == "The capital of France is Paris."
    assert whole.content == "Paris"
    # token by token and in random chunks: the same text (streaming == non-streaming)
    assert parse(tok, ctl, ids, chunks=[1] * len(ids)) == whole
    rng = random.Random(0)
    for _ in range(5):
        assert parse(tok, ctl, ids, chunks=[rng.randint(1, 4) for _ in range(len(ids))]) == whole


def test_no_control_text_ever_reaches_content(tok, ctl):
    ids = (text_ids(tok, "A") + [ctl.think, 105] + text_ids(tok, "B") + [ctl.channel_close, 1]
           + text_ids(tok, "C") + [ctl.turn_end] + text_ids(tok, "D"))
    d = parse(tok, ctl, ids)
    assert d.content == "ABCD" and d.reasoning == ""
    assert control_text_in(tok.decode(ids)) and not control_text_in(d.content)


def test_channel_name_without_newline_is_dropped_not_leaked(tok, ctl):
    ids = [ctl.channel_open] + text_ids(tok, "thought") + [ctl.channel_close] + text_ids(tok, "7") + [ctl.turn_end]
    assert parse(tok, ctl, ids) == Delta(reasoning="", content="7")


def test_reply_cut_inside_the_thought_block_has_no_content(tok, ctl):
    ids = [ctl.channel_open] + text_ids(tok, "thought\nLet me think about the")
    assert parse(tok, ctl, ids, chunks=[1] * len(ids)) == Delta(reasoning="Let me think about the", content="")


def test_prompt_state_decides_where_the_reply_starts(tok, ctl):
    answer = text_ids(tok, "Paris") + [ctl.turn_end]
    closed = text_ids(tok, "x") + [ctl.channel_open] + text_ids(tok, "thought\n") + [ctl.channel_close]
    assert parse(tok, ctl, answer, prompt_ids=closed) == Delta(content="Paris")
    # a template that opens the thought block for the model: the reply is reasoning until <channel|>
    opened = text_ids(tok, "x") + [ctl.channel_open] + text_ids(tok, "thought\n")
    reply = text_ids(tok, "France") + [ctl.channel_close] + answer
    assert parse(tok, ctl, reply, prompt_ids=opened) == Delta(reasoning="France", content="Paris")
    assert parse(tok, ctl, reply, prompt_ids=opened, chunks=[1] * len(reply)) == Delta(reasoning="France",
                                                                                        content="Paris")
    # only the model's turn counts: <|channel> typed by the user (tokenized as the control id, as
    # in vLLM) leaves the answer in content
    typed = [2, ctl.turn_open] + text_ids(tok, "user\nWhat is it? ") + [ctl.channel_open, ctl.turn_end] + [
        ctl.turn_open] + text_ids(tok, "model\n")
    assert parse(tok, ctl, answer, prompt_ids=typed) == Delta(content="Paris")
    assert parse(tok, ctl, reply, prompt_ids=typed + [ctl.channel_open] + text_ids(tok, "thought\n")) == Delta(
        reasoning="France", content="Paris")


def test_multibyte_text_is_never_split_into_replacement_characters(tok, ctl):
    text = "Zürich – 東京 🙂"
    ids = text_ids(tok, text)
    assert len(ids) > len(text) / 2  # byte-level pieces: characters span several ids
    p = ReplyParser(tok, ctl)
    pieces = [p.feed(t).content for t in ids] + [p.finish().content]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("chunks, stops, released, hit", [
    (["Par", "is is", " nice"], ["is is"], "Par", True),
    (["The end", "ing"], ["ending"], "The ", True),
    (["abc", "def"], ["xyz"], "abcdef", False),
    (["ab", "c"], ["bcd"], "abc", False),  # held "bc" released at finish
    (["one. two", ". three"], [". t", "two"], "one", True),  # earliest match wins
])
def test_stop_strings(chunks, stops, released, hit):
    m = StopMatcher(stops)
    out = "".join(m.feed(c) for c in chunks) + m.finish()
    assert (out, m.hit) == (released, hit)


def test_stop_matcher_holds_back_possible_prefixes():
    m = StopMatcher(["</s>"])
    assert m.feed("hello <") == "hello "
    assert m.feed("/") == ""
    assert m.feed("x") == "</x"


def test_render_prompt_single_bos_and_thinking(tok, ctl):
    ids = render_prompt(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids == tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    # content as text parts renders the same
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    assert render_prompt(tok, [{"role": "user", "content": parts}]) == ids

    t = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    t.chat_template = THINKING_TEMPLATE
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    on = render_prompt(t, msgs, {"enable_thinking": True})
    off = render_prompt(t, msgs, {"enable_thinking": False})
    assert ctl.think in on and ctl.channel_open not in on
    assert ctl.think not in off and off[-1] == ctl.channel_close and ctl.channel_open in off
    assert on.count(t.bos_token_id) == off.count(t.bos_token_id) == 1
    # thinking off: the model's answer after the closed empty block is content
    assert parse(t, ctl, text_ids(t, "4") + [ctl.turn_end], prompt_ids=off) == Delta(content="4")
    # thinking on: a thought block and the answer
    reply = [ctl.channel_open] + text_ids(t, "thought\n2 plus 2") + [ctl.channel_close] + text_ids(t, "4")
    assert parse(t, ctl, reply, prompt_ids=on) == Delta(reasoning="2 plus 2", content="4")


def test_render_prompt_errors(tok):
    with pytest.raises(ChatError, match="tokenize"):
        render_prompt(tok, [{"role": "user", "content": "x"}], {"tokenize": False})
    with pytest.raises(ChatError, match="image_url"):
        render_prompt(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    t = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    t.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatError, match="roles must alternate"):
        render_prompt(t, [{"role": "user", "content": "x"}])


def test_sampling():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample_next(logits, SamplingParams(1, temperature=0), None) == 1
    # top_k=1 and a tiny nucleus leave only the most likely id
    for p in (SamplingParams(1, temperature=1.0, top_k=1), SamplingParams(1, temperature=1.0, top_p=0.01),
              SamplingParams(1, temperature=1.0, top_p=1e-300)):  # 0 in fp32: still the top id, not an error
        assert {sample_next(logits, p, torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    # top_p=0.9 keeps ids 1 and 2 only (their mass is about 0.93)
    p = SamplingParams(1, temperature=1.0, top_p=0.9)
    assert {sample_next(logits, p, torch.Generator().manual_seed(s)) for s in range(200)} == {1, 2}
    # a seed fixes the draw
    p = SamplingParams(1, temperature=2.0)
    draws = lambda seed: [sample_next(logits, p, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(30)]
    assert draws(3) == draws(3) and len(set(draws(3))) > 1
