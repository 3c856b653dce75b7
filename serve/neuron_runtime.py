"""Neuron-side loading of an int8-neuron result: the per-rank weight list that
neuronx-distributed's ``nxd_model.initialize`` takes, checked against the layout table.

Spec: ../shared/specs/nxd-int8-neuron.md §3.3-§3.5 (aws-neuron/neuronx-distributed
``trace/spmd.py`` ``NxDModel.initialize(checkpoint: List[Dict[str, Tensor]], start_rank)``;
NxDI ``models/application_base.py`` ``load_weights``): one dict per local rank, keys the
traced module's ``state_dict()`` names, per-rank shapes, exact dtypes (int8 weights, fp32
scales, bf16 otherwise), contiguous tensors.

What is here runs on any machine: :func:`expected_rank_specs` derives every rank file's
names, dtypes and shapes from the config alone through the shared table, and
:func:`load_rank_weights` refuses files that differ. :func:`initialize_traced` imports
torch-neuronx lazily and has not yet run on inf2 hardware; the Neuron module tree and the
ModelBuilder trace that produce the ``model.pt`` it loads are not part of g4 yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from g4.convert.errors import CheckpointError, G4Error
from g4.exporters.safetensors_writer import TensorSpec
from g4.serve.neuron_layout import MODEL_ENTRIES, Geometry, entry_specs, geometry, layer_entries


def _source_shapes(g: Geometry, layer: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face shapes of one decoder layer's tensors, from the geometry alone."""
    H, hd, E, I = g.hidden, g.head_dim[layer], g.experts, g.moe_intermediate
    kv = g.kv_heads[layer] * hd
    shapes = {
        "self_attn.q_proj.weight": (g.heads * hd, H), "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, g.heads * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (g.intermediate, H), "mlp.up_proj.weight": (g.intermediate, H),
        "mlp.down_proj.weight": (H, g.intermediate),
        "router.proj.weight": (E, H), "router.scale": (H,), "router.per_expert_scale": (E,),
        "experts.gate_up_proj": (E, 2 * I, H), "experts.down_proj": (E, H, I), "layer_scalar": (1,),
    }
    return shapes | {f"{n}.weight": (H,) for n in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")}


def expected_rank_specs(config: dict, tp: int, *, quantize_attention: bool,
                        dtype: torch.dtype = torch.bfloat16) -> list[TensorSpec]:
    """Every tensor of one rank file (name, dtype, per-rank shape), from the config alone.

    Raises:
        G4Error: a TP degree the model cannot be split over.
    """
    g = geometry(config, tp)
    specs: list[TensorSpec] = []
    for L in range(g.num_layers):
        shapes = _source_shapes(g, L)
        for e in layer_entries(has_v=g.has_v[L], quantize_attention=quantize_attention):
            specs += entry_specs(e, f"layers.{L}.", shapes[e.source], dtype, g, L)
    model_shapes = {"norm.weight": (g.hidden,), "embed_tokens.weight": (g.vocab, g.hidden)}
    for e in MODEL_ENTRIES:
        specs += entry_specs(e, "", model_shapes[e.source], dtype, g, None)
    return specs


def load_rank_weights(out_dir: str | Path) -> list[dict[str, torch.Tensor]]:
    """The per-rank state dicts of an int8-neuron result, in rank order, each checked
    exactly (names, dtypes, shapes) against :func:`expected_rank_specs`.

    Raises:
        CheckpointError: missing manifest/files, or a rank file that differs from the table
            (naming the rank, the tensor and what differs).
    """
    out_dir = Path(out_dir)
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{out_dir}: not an int8-neuron result ({e})") from e
    expected = {s.name: s for s in expected_rank_specs(
        config, manifest["tp_degree"], quantize_attention="attention" in manifest["quantization"]["quantized"])}
    weights = []
    for rank, file in enumerate(manifest["rank_files"]):
        path = out_dir / file
        if not path.is_file():
            raise CheckpointError(f"{path}: rank {rank} weight file is missing")
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(expected):
                extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
                raise CheckpointError(f"{path}: keys differ from the layout table (missing {missing[:3]}, "
                                      f"unexpected {extra[:3]})")
            sd = {}
            for name in sorted(names):
                t = f.get_tensor(name)
                spec = expected[name]
                if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                    raise CheckpointError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, the layout says "
                                          f"{spec.dtype} {list(spec.shape)} for rank {rank}")
                sd[name] = t.contiguous()
        weights.append(sd)
    return weights


def initialize_traced(model_pt: str | Path, out_dir: str | Path, *, start_rank: int = 0):
    """Load a weight-less traced Neuron model and bind this result's per-rank weights to it
    (``torch.jit.load(model_pt).nxd_model.initialize(weights, start_rank)``).

    Not yet run on inf2 hardware; requires torch-neuronx (Neuron SDK 2.28 for inf2).

    Raises:
        G4Error: torch-neuronx is not installed (one line), or the weights fail
            :func:`load_rank_weights`.
    """
    try:
        import torch_neuronx  # noqa: F401  (registers the Neuron custom ops the traced model uses)
    except ImportError as e:
        raise G4Error("torch-neuronx / neuronx-distributed are not installed here (Neuron SDK 2.28 for inf2); "
                      "the CPU emulator is g4.serve.neuron_emulator") from e
    weights = load_rank_weights(out_dir)
    traced = torch.jit.load(str(model_pt))
    traced.nxd_model.initialize(weights, torch.tensor([start_rank], dtype=torch.int32))
    return traced
