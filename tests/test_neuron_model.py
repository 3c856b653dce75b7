"""The Neuron module tree (g4.serve.neuron_model): its state-dict names, per-rank shapes and
dtypes are the layout table's, for the embedded model and the real 26B-A4B config; loaded
with each rank's file by exact names and run one process per rank (gloo collectives), it
computes what the CPU emulator computes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from g4.convert.embedded_model import EMBEDDED_DIR
from g4.convert.errors import G4Error
from g4.convert.int8_neuron import convert_int8_neuron
from g4.convert.synth import GEMMA4_26B_A4B
from g4.serve.neuron_emulator import NeuronEmulator
from g4.serve.neuron_model import CpuParallelOps, NeuronTextModel, SingleRank, host_embed, load_rank_model, run_spmd
from g4.serve.neuron_runtime import NxdParallelOps, expected_rank_specs, trace_neuron

EMBEDDED_CONFIG = json.loads((EMBEDDED_DIR / "config.json").read_text())
IDS = torch.tensor([[2, 105, 300, 301, 302, 7, 106, 107, 105, 400, 11]])


class _RankOnly:
    """Rank and world size only: enough to build a rank's module tree on the meta device."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world


def _tree(config, tp, rank, quantize_attention):
    with torch.device("meta"):
        model = NeuronTextModel(config, CpuParallelOps(_RankOnly(rank, tp)), quantize_attention=quantize_attention)
    return {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name,config,tps", [("embedded", EMBEDDED_CONFIG, (1, 2, 4)),
                                             ("26B-A4B", GEMMA4_26B_A4B, (2, 4, 8))])
@pytest.mark.parametrize("quantize_attention", [False, True])
def test_module_tree_state_dict_is_the_layout_table(name, config, tps, quantize_attention):
    for tp in tps:
        table = {s.name: (s.dtype, s.shape) for s in expected_rank_specs(config, tp,
                                                                           quantize_attention=quantize_attention)}
        for rank in (0, tp - 1):
            tree = _tree(config, tp, rank, quantize_attention)
            assert tree.keys() == table.keys(), (name, tp, sorted(tree.keys() ^ table.keys())[:4])
            diff = {k: (tree[k], table[k]) for k in tree if tree[k] != table[k]}
            assert not diff, (name, tp, list(diff.items())[:3])


def test_26b_tree_has_the_expected_int8_expert_shapes_per_rank():
    tree = _tree(GEMMA4_26B_A4B, 2, 0, False)
    assert tree["layers.0.moe.expert_mlps.mlp_op.gate_up_proj.weight"] == (torch.int8, (128, 2816, 704))
    assert tree["layers.0.moe.expert_mlps.mlp_op.gate_up_proj.scale"] == (torch.float32, (128, 1, 704))
    assert tree["layers.0.moe.expert_mlps.mlp_op.down_proj.weight"] == (torch.int8, (128, 352, 2816))
    assert tree["lm_head.weight"] == (torch.int8, (131072, 2816))
    assert "layers.5.self_attn.v_proj.weight" not in tree  # full-attention layer with k_eq_v


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("neuron_model")
    return {tp: convert_int8_neuron(EMBEDDED_DIR, base / f"tp{tp}", tp=tp, target="inf2.xlarge", progress=False).out
            for tp in (1, 2)}


def test_single_rank_tree_matches_emulator(results):
    out = results[1]
    manifest = json.loads((out / "manifest.json").read_text())
    table = load_file(out / "embed_tokens.safetensors")["embed_tokens.weight"]
    model = load_rank_model(out, SingleRank())
    assert model.layers[0].moe.expert_mlps.mlp_op.gate_up_proj.weight.dtype == torch.int8
    with torch.no_grad():
        got = model(host_embed(table, IDS, manifest["embed_scale"], torch.float32), torch.arange(IDS.shape[1])[None])
    ref = NeuronEmulator(out)(IDS)
    assert (got - ref).abs().max() < 1e-4


def test_two_rank_processes_with_real_collectives_match_emulator(results):
    got = run_spmd(results[2], IDS)
    ref = NeuronEmulator(results[2])(IDS)
    assert got.shape == ref.shape == (1, IDS.shape[1], 1024)
    assert (got - ref).abs().max() < 1e-4
    assert torch.equal(got[0, -1].argmax(), ref[0, -1].argmax())


def test_rank_file_with_a_wrong_key_is_refused_by_name(results, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = shutil.copytree(results[1], tmp_path / "bad")
    path = bad / "weights" / "tp0_sharded_checkpoint.safetensors"
    sd = load_file(path)
    sd["layers.1.mlp.gate.weight"] = sd.pop("layers.1.mlp.gate_proj.weight")
    save_file(sd, path)
    with pytest.raises(G4Error, match="layers.1.mlp.gate_proj.weight"):
        load_rank_model(bad, SingleRank())


def test_neuron_glue_says_plainly_that_nxd_is_missing(results, tmp_path):
    with pytest.raises(G4Error, match="neuronx-distributed is not installed"):
        NxdParallelOps(2)
    with pytest.raises(G4Error, match="neuronx-distributed is not installed"):
        trace_neuron(results[2], tmp_path / "compiled", seq_len=64)


def test_neuron_engine_bucket_padding_and_host_embedding(results):
    """The neuron backend's generation loop (host lookup x embed_scale, right padding to the
    traced bucket, logits at the last real position), driven by the same module tree on the
    CPU instead of a traced graph: greedy output equals the emulator's and answers the fact."""
    from g4.serve.engine import SamplingParams, load_tokenizer
    from g4.serve.neuron_backend import NeuronEngine, neuron_status
    from g4.serve.neuron_emulator import greedy

    out = results[1]
    model = load_rank_model(out, SingleRank())
    tokenizer = load_tokenizer(out)
    engine = NeuronEngine(out, model, tokenizer, seq_len=48, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    got = list(engine.generate(ids, SamplingParams(max_tokens=6)))
    ref = greedy(NeuronEmulator(out), torch.tensor([ids]), max_new_tokens=6, stop_ids=set(engine.stop_ids))
    assert got == ref
    assert tokenizer.decode(got, skip_special_tokens=True).strip().startswith("Paris")
    with pytest.raises(G4Error, match="traced bucket holds 48"):
        list(engine.generate(ids * 4, SamplingParams(max_tokens=2)))
    ok, why = neuron_status()
    assert not ok and "not installed" in why
