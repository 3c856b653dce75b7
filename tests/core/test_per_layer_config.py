"""P17: a source whose config is in transformers' ``per_layer_config`` form converts, and OUT
carries the release keys (``global_head_dim``, ``num_global_key_value_heads``) that vLLM reads."""

import copy
import json
import shutil

import pytest
from click.testing import CliRunner

from g4.convert.cli import main
from g4.convert.embedded_model import EMBEDDED_DIR
from g4.core.errors import G4Error
from g4.core.gemma4 import attention_layers, release_config

RELEASE = json.loads((EMBEDDED_DIR / "config.json").read_text())


def hf_layers(path):
    """(head_dim, KV heads) per layer as transformers 5.24 builds them from ``path``."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(path).get_text_config()
    return [(layer.head_dim, layer.num_key_value_heads) for layer in tc.per_layer_config]


@pytest.fixture(scope="module")
def resaved(tmp_path_factory):
    """The embedded checkpoint with its config re-saved by transformers 5.24."""
    from transformers import Gemma4Config

    src = shutil.copytree(EMBEDDED_DIR, tmp_path_factory.mktemp("p17") / "src")
    Gemma4Config.from_pretrained(src).save_pretrained(src)
    text = json.loads((src / "config.json").read_text())["text_config"]
    assert "per_layer_config" in text and "global_head_dim" not in text and "num_global_key_value_heads" not in text
    return src


@pytest.mark.parametrize("target", [["nvfp4", "--calib-samples", "4", "--calib-seq-len", "32"],
                                    ["int8-neuron", "--tp", "2"]], ids=["nvfp4", "int8-neuron"])
def test_per_layer_config_source_gives_release_keys(resaved, tmp_path, target):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["-q", target[0], str(resaved), str(out), *target[1:]])
    assert r.exit_code == 0, r.output
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert (text["global_head_dim"], text["num_global_key_value_heads"]) == (64, 1)
    assert "per_layer_config" not in text
    assert text == RELEASE["text_config"]  # every other key as the source has it
    assert hf_layers(out) == hf_layers(resaved) == hf_layers(EMBEDDED_DIR) == [(32, 2)] * 3 + [(64, 1)]


def test_both_forms_read_alike_and_release_config_round_trips(resaved):
    per_layer = json.loads((resaved / "config.json").read_text())
    assert attention_layers(per_layer) == attention_layers(RELEASE)
    assert release_config(per_layer)["text_config"] == RELEASE["text_config"]
    assert release_config(RELEASE) == RELEASE
    # transformers pads to the widest index ("05" for 30 layers); an empty override list means no override
    text = copy.deepcopy(RELEASE["text_config"])
    del text["global_head_dim"], text["num_global_key_value_heads"]
    wide = dict(text, num_hidden_layers=12, layer_types=["sliding_attention"] * 11 + ["full_attention"],
                per_layer_config={"11": {"head_dim": 64, "num_key_value_heads": 1}})
    assert [(a.head_dim, a.kv_heads) for a in attention_layers(wide)] == [(32, 2)] * 11 + [(64, 1)]
    assert [a.head_dim for a in attention_layers(dict(text, per_layer_config={}))] == [32] * 4


@pytest.mark.parametrize("per_layer, why", [
    ({"0": {"head_dim": 64}, "3": {"head_dim": 64, "num_key_value_heads": 1}}, "changes sliding layer 0"),
    ({"3": {"head_dim": 64, "sliding_window": 8}}, "overrides sliding_window"),
    ({"7": {"head_dim": 64}}, "entry '7' is not a layer index"),
])
def test_per_layer_config_the_release_form_cannot_carry_is_refused(per_layer, why):
    config = copy.deepcopy(RELEASE)
    config["text_config"]["per_layer_config"] = per_layer
    with pytest.raises(G4Error, match=why):
        release_config(config)


def test_per_layer_config_that_disagrees_with_the_weights_is_refused(resaved, tmp_path):
    src = shutil.copytree(resaved, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["per_layer_config"]["3"]["head_dim"] = 32
    (src / "config.json").write_text(json.dumps(config))
    r = CliRunner().invoke(main, ["-q", "int8-neuron", str(src), str(tmp_path / "out"), "--tp", "2"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert "self_attn.q_proj.weight: [256, 128], config says [128, 128] (full attention: head_dim 32" in r.output


def test_per_layer_config_the_release_form_cannot_carry_stops_the_conversion(resaved, tmp_path):
    src = shutil.copytree(resaved, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["per_layer_config"]["3"]["sliding_window"] = 8
    (src / "config.json").write_text(json.dumps(config))
    r = CliRunner().invoke(main, ["-q", "nvfp4", str(src), str(tmp_path / "out"), "--weight-only"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith(f"error: {src / 'config.json'}: text config: per_layer_config['3'] overrides sliding_window")
    assert not (tmp_path / "out").exists()


def test_verify_accepts_the_release_form_out_of_a_per_layer_config_source(resaved, tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(main, ["-q", "nvfp4", str(resaved), str(out), "--weight-only"]).exit_code == 0
    r = runner.invoke(main, ["-q", "verify", str(out), "--against", str(resaved), "--max-new-tokens", "1",
                             "--min-agreement", "0"])
    assert r.exit_code == 0 and "facts answered: 12/12" in r.output, r.output
