"""Tampered copies of finished results, for the tests that every command refuses them before
trusting them (``g4.exporters.formats.check_result``): one safetensors file rewritten without a
tensor, with a tensor renamed, stored in another dtype or cut to another shape.

Each tamper is ``(mutate(state_dict), expected)``: ``expected`` is the text the one ``error:``
line must carry after ``error: <file>: `` (the file holding the tampered tensor), so a test
asserts the file, the tensor and what differs.
"""

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

L = "model.language_model.layers"


def _drop(name):
    return lambda sd: sd.pop(name)


def _rename(old: str, new: str):
    def mutate(sd):
        for k in [k for k in sd if k.startswith(old + ".")]:
            sd[new + k[len(old):]] = sd.pop(k)
    return mutate


def _to(name: str, dtype: torch.dtype):
    return lambda sd: sd.__setitem__(name, sd[name].to(dtype))


def _cut(name: str):
    return lambda sd: sd.__setitem__(name, sd[name][..., :-1].contiguous())


# On the embedded NVFP4 W4A4 result (tests/serve_fixtures.py embedded_result("nvfp4")).
NVFP4_TAMPERS = {
    "dropped input_scale": (
        _drop(f"{L}.3.self_attn.o_proj.input_scale"),
        re.escape(f"module {L}.3.self_attn.o_proj: has ['weight', 'weight_scale', 'weight_scale_2'], expected "
                  "['weight', 'weight_scale', 'weight_scale_2', 'input_scale'] (missing ['input_scale']")),
    "renamed expert tensor": (
        _rename(f"{L}.1.experts.3.up_proj", f"{L}.1.experts.3.upx_proj"),
        re.escape(f"tensor {L}.1.experts.3.upx_proj.") + r"\w+" + re.escape(": not in the NVFP4 output table")),
    "weight_scale_2 as int32": (
        _to(f"{L}.1.experts.2.down_proj.weight_scale_2", torch.int32),
        re.escape(f"tensor {L}.1.experts.2.down_proj.weight_scale_2: torch.int32 [], expected torch.float32 []")),
    "changed shape": (
        _cut(f"{L}.1.experts.2.down_proj.weight"),
        re.escape(f"tensor {L}.1.experts.2.down_proj.weight: torch.uint8 [128, 31], expected torch.uint8 [128, 32]")),
}

# On the embedded int8-neuron result at TP 2 (embedded_result("int8-neuron")), rank 1's file.
RANK1 = "weights/tp1_sharded_checkpoint.safetensors"
INT8_TAMPERS = {
    "renamed rank tensor": (
        _rename("layers.2.moe.expert_mlps.mlp_op.down_proj", "layers.2.moe.expert_mlps.mlp_op.downx_proj"),
        re.escape("keys differ from the layout table (missing ['layers.2.moe.expert_mlps.mlp_op.down_proj.scale', "
                  "'layers.2.moe.expert_mlps.mlp_op.down_proj.weight'], unexpected "
                  "['layers.2.moe.expert_mlps.mlp_op.downx_proj.scale', "
                  "'layers.2.moe.expert_mlps.mlp_op.downx_proj.weight'])")),
    "reshaped rank tensor": (
        _cut("layers.0.self_attn.o_proj.weight"),
        re.escape("tensor layers.0.self_attn.o_proj.weight is torch.bfloat16 [128, 63], the layout says "
                  "torch.bfloat16 [128, 64] for rank 1")),
}


def tampered_copy(result: Path, dst: Path, mutate, file: str = "model.safetensors") -> Path:
    """A copy of ``result`` at ``dst`` whose ``file`` is rewritten with ``mutate(state_dict)``
    applied (metadata files untouched, so only the table check can tell)."""
    shutil.copytree(result, dst)
    sd = load_file(dst / file)
    mutate(sd)
    save_file(sd, dst / file, metadata={"format": "pt"})
    return dst


def assert_one_error_line(output: str, path: Path, expected: str) -> None:
    """``output`` is exactly one ``error: <path>: ...`` line carrying ``expected`` (a regex)."""
    assert output.count("\n") == 1 and output.startswith(f"error: {path}: "), output
    assert re.search(expected, output), output
