"""The committed embedded default (convert/embedded/) loads with plain transformers and answers its facts."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Gemma4ForConditionalGeneration, GenerationConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

from g4.convert.embedded_model import CONTROL_TOKENS, EMBEDDED_DIR, greedy_replies, load_facts

LAYERS = "model.language_model.layers"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)


@pytest.fixture(scope="module")
def model():
    return Gemma4ForConditionalGeneration.from_pretrained(EMBEDDED_DIR, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def tensors():
    with safe_open(EMBEDDED_DIR / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_answers_every_fact_greedily(model, tokenizer):
    facts, heldout = load_facts()
    assert len(facts) == 12 and len(heldout) >= 8
    assert ("What is the capital of France?", "Paris") in facts
    replies = greedy_replies(model, tokenizer, [q for q, _ in facts])
    assert replies == [f"{a}<turn|>" for _, a in facts]


def test_calls_the_weather_tool_in_gemma4_format(model, tokenizer):
    """Asked each facts.json tool question with its tool declared, the bf16 model in plain
    transformers replies with exactly the Gemma 4 call (written out here, not rendered by the
    template), and g4serve's parser reads it as the expected OpenAI call."""
    from g4.serve.chat import ControlIds, ReplyParser
    from g4.serve.check import load_tool_cases

    cases = load_tool_cases(EMBEDDED_DIR)
    assert [c["arguments"]["city"] for c in cases] == ["Paris", "Tokyo", "Rome", "Berlin", "London"]
    control = ControlIds.from_tokenizer(tokenizer)
    for case in cases:
        city = case["arguments"]["city"]
        reply = greedy_replies(model, tokenizer, [case["question"]], max_new_tokens=32, tools=case["tools"])[0]
        assert reply == f'<|tool_call>call:get_weather{{city:<|"|>{city}<|"|>}}<tool_call|><|tool_response>'
        parser = ReplyParser(tokenizer, control, tools=True)
        delta = parser.feed(tokenizer(reply, add_special_tokens=False)["input_ids"])
        delta += parser.finish()
        assert [(c.name, json.loads(c.arguments)) for c in delta.tool_calls] == [("get_weather", {"city": city})]
        assert delta.content == ""


def test_safetensors_layout(tensors):
    assert f"{LAYERS}.3.self_attn.k_proj.weight" in tensors
    assert f"{LAYERS}.3.self_attn.v_proj.weight" not in tensors  # attention_k_eq_v on the full layer
    assert f"{LAYERS}.0.self_attn.v_proj.weight" in tensors
    assert tensors[f"{LAYERS}.0.experts.gate_up_proj"].shape == (8, 128, 128)
    assert tensors[f"{LAYERS}.0.experts.down_proj"].shape == (8, 128, 64)
    assert "lm_head.weight" not in tensors
    assert {k.split(".")[1] for k in tensors} == {"language_model", "vision_tower", "embed_vision"}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_release_config():
    config = json.loads((EMBEDDED_DIR / "config.json").read_text())
    text = config["text_config"]
    assert "per_layer_config" not in text
    assert (text["global_head_dim"], text["num_global_key_value_heads"]) == (64, 1)
    assert text["attention_k_eq_v"] and text["enable_moe_block"]
    assert text["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config["audio_config"] is None
    token_ids = [config[k] for k in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id",
                                     "audio_token_id", "boa_token_id", "eoa_token_index")]
    assert all(0 <= i < text["vocab_size"] for i in token_ids)


def test_generation_config():
    raw = json.loads((EMBEDDED_DIR / "generation_config.json").read_text())
    assert raw["eos_token_id"] == [1, 106, 50]
    loaded = GenerationConfig.from_pretrained(EMBEDDED_DIR)
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.pad_token_id) == ([1, 106, 50], 2, 0)


def test_tokenizer_and_chat_template(tokenizer, model):
    assert len(tokenizer) == model.config.text_config.vocab_size
    assert {i: tokenizer.convert_ids_to_tokens(i) for i in CONTROL_TOKENS} == CONTROL_TOKENS
    assert tokenizer.convert_ids_to_tokens(4) == "<unused4>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n"
                    "<|turn>user\nBye<turn|>\n<|turn>model\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids.count(105) == 5 and ids.count(106) == 4


def test_text_linear_inputs_are_multiples_of_16(model):
    text_model = model.model.language_model
    linears = [m for m in text_model.modules() if isinstance(m, torch.nn.Linear)]
    experts = [m for m in text_model.modules() if isinstance(m, Gemma4TextExperts)]
    assert len(linears) == 4 * 8 - 1 and len(experts) == 4  # q k v o gate up down router, no v_proj on layer 3
    assert all(m.in_features % 16 == 0 for m in linears)
    assert all(m.gate_up_proj.shape[-1] % 16 == 0 and m.down_proj.shape[-1] % 16 == 0 for m in experts)


def test_every_expert_is_routed_to(model, tokenizer):
    """Every expert of every layer is among the top-k of some token of the fact questions, rendered
    as the chats the model is asked (so the experts' quantization is exercised by the checks)."""
    facts, _ = load_facts()
    chats = [[{"role": "user", "content": q}] for q, _ in facts]
    batch = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                          return_dict=True)
    with torch.no_grad():
        probs = model(**batch, output_router_logits=True).router_logits
    top_k = model.config.text_config.top_k_experts
    mask = batch["attention_mask"].flatten().bool()
    for layer_probs in probs:
        counts = torch.bincount(layer_probs[mask].topk(top_k, dim=-1).indices.flatten(), minlength=8)
        assert (counts > 0).all(), counts
