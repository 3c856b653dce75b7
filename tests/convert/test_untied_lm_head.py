"""An untied model (``tie_word_embeddings: false``, its own ``lm_head.weight``) gets its own
head in both targets, never one built from ``embed_tokens``; an untied config without
``lm_head.weight`` is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

import tiny
from g4.core.checkpoint import Checkpoint
from g4.core.errors import MappingError
from g4.convert.int8_neuron import convert_int8_neuron
from g4.exporters.neuron_int8 import rank_file
from g4.convert.nvfp4 import convert_nvfp4
from g4.quantizers import int8
from g4.serve.neuron_emulator import NeuronEmulator
from g4.convert.reference import load_converted_model, load_source_model


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    src = tiny.build(tmp_path_factory.mktemp("untied") / "src", multimodal=False, tie_word_embeddings=False)
    ckpt = Checkpoint(src)
    assert not ckpt.arch.tied and "lm_head.weight" in ckpt.tensors
    head, embed = ckpt.get("lm_head.weight"), ckpt.get("model.embed_tokens.weight")
    assert not torch.equal(head, embed)
    return src, head, embed


def test_nvfp4_keeps_the_untied_head_and_the_reference_uses_it(untied, tmp_path):
    src, head, embed = untied
    out = convert_nvfp4(src, tmp_path / "out", weight_only=True, progress=False).out
    written = load_file(out / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], head)
    model = load_converted_model(out, src)
    assert torch.equal(model.lm_head.weight, head) and not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(load_source_model(src).lm_head.weight, head)


def test_int8_neuron_builds_the_head_from_lm_head_weight(untied, tmp_path):
    src, head, embed = untied
    out = convert_int8_neuron(src, tmp_path / "out", tp=2, target=None, progress=False).out
    ranks = [load_file(out / rank_file(r)) for r in range(2)]
    got = torch.cat([int8.dequantize(int8.Int8Weight(sd["lm_head.weight"], sd["lm_head.scale"])) for sd in ranks])
    want = int8.dequantize(int8.quantize(head))
    assert torch.equal(got, want) and not torch.equal(got, int8.dequantize(int8.quantize(embed)))
    host = load_file(out / "embed_tokens.safetensors")["embed_tokens.weight"]
    assert torch.equal(host, embed)  # the host lookup table is still embed_tokens
    ids = torch.tensor([[2, 17, 99, 500, 7, 300, 301]])
    ref = load_source_model(src, torch.float32)
    with torch.no_grad():
        want = ref(ids).logits
        ref.lm_head.weight.copy_(ref.model.embed_tokens.weight)  # what an embed-built head would give
        wrong = ref(ids).logits
        got = NeuronEmulator(out)(ids)
    err, wrong_err = (got - want).abs().max().item(), (got - wrong).abs().max().item()
    assert err < 0.1 * wrong_err, (err, wrong_err)


def test_untied_config_without_lm_head_is_refused(untied, tmp_path):
    src, _, _ = untied
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).symlink_to(f)
    sd = load_file(src / "model.safetensors")
    del sd["lm_head.weight"]
    (bad / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    for convert in (lambda o: convert_nvfp4(bad, o, weight_only=True, progress=False),
                    lambda o: convert_int8_neuron(bad, o, tp=2, target=None, progress=False)):
        with pytest.raises(MappingError, match="lm_head.weight: missing although tie_word_embeddings is false"):
            convert(tmp_path / "out")
        assert not (tmp_path / "out").exists()
    json.loads((bad / "config.json").read_text())
