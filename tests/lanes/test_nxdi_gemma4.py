"""g4's Gemma 4 MoE model class for NxD Inference (``g4/serve/nxdi_gemma4.py``) run through NxDI 0.8's
own CPU engine, against transformers' Gemma 4 (marker ``nxd_cpu``; on by default).

Sources: aws-neuron/neuronx-distributed at tag ``v2.28.0`` and aws-neuron/neuronx-distributed-inference
at its "Neuron SDK Release 2.28.0" commit (0.8.0); ``G4_NXD_SRC`` / ``G4_NXDI_SRC`` name their ``src``
folders (default: the unmodified snapshots beside the repository, as ``tests/lanes/test_nxd_cpu.py``);
without them the lane is skipped with that reason.

NxDI 0.8 imports only with transformers 4.57 (its pin; 5.x removed
``transformers.generation.SampleDecoderOnlyOutput``), while the reference is transformers 5.24 (4.57 has
no Gemma 4). So the NxDI side runs in a subprocess (``tests/lanes/nxd_cpu/nxdi_worker.py``) of g4's venv
with a transformers 4.57 overlay first on ``PYTHONPATH``: ``G4_NXDI_OVERLAY`` (default
``.venv-nxdi/tf457`` in the repository, git-ignored), built here with pip on first use if absent
(``pip install --target DIR --no-deps transformers==4.57.* huggingface-hub<1.0 tokenizers<=0.23
requests fsspec scipy``: about 35 s on 2 cores); skipped with the reason if pip cannot build it.

Each worker: ``NeuronConfig(on_cpu=True, tp_degree=T, seq_len=32)``, ``to_cpu()`` (NxDI builds the
class, shards the checkpoint with NxD's ``get_sharded_checkpoint`` and loads it), then greedy through
``NeuronBaseForCausalLM.forward``: one context-encoding call on the prompt (padded to 32 by NxDI's
model wrapper) and one token-generation call per further token on NxDI's KV cache. The reference is
transformers' ``Gemma4ForConditionalGeneration`` on the same checkpoint in fp32, greedy with its own
cache. Cases (embedded tiny model: 3 sliding layers head_dim 32 / 2 KV heads, 1 full k_eq_v layer
head_dim 64 / 1 KV head with proportional RoPE, 8 experts top-2, tied lm_head):

- ``chat``: a chat-formatted fact question, 12 tokens (11 decode steps);
- ``window4``: the same weights with ``sliding_window = 4`` on both sides (the shipped window, 64, is
  wider than the 32 positions, so this is the case that exercises windowed attention in context
  encoding and in decode), 12 tokens from a 19-token question: the sliding layers' KV cache is a
  ring of 3 slots (``g4.core.gemma4.kv_cache_positions``) that context encoding fills with the
  prompt's last 3 positions and token generation overwrites up to position 30, 3 windows and more
  past the window; ``window4_tp2`` the same at TP 2;
- ``chat_tp2``: ``chat`` at TP 2, one process per rank (gloo, the environment torchrun would set);
  both ranks must give the reference's ids and logits;
- ``chat_bf16``: ``chat`` with bf16 weights and activations, against the fp32 reference
  (``TOL_BF16`` = 0.25);
- ``int8``: ``g4convert int8-neuron --tp 1`` of the embedded model (``NeuronConfig(quantized=True)``):
  NxD's int8 layers for experts, dense MLP and lm_head. The int8 reference (``_int8_reference``) shares
  no code with g4: the test reads the rank files itself (safetensors, ``manifest.json``), reassembles
  every TP rank's tensors by NxD's column/row-parallel partitioning (:data:`NXD_PARTITION`; the fused
  experts' stride-2 ``[gate_r | up_r]``, KV heads NxDI repeated taken once), dequantizes each int8
  ``weight`` as ``q * scale`` with its fp32 per-channel scale in plain torch, and loads that strictly
  into transformers' ``Gemma4ForCausalLM`` built from the source checkpoint's config (lm_head untied:
  the int8 head is not the bf16 embedding), fp32, greedy on its own cache; tolerance ``TOL``. That
  these weights are the source rounded per channel by NxD's rule (scales ``absmax/127`` computed here
  from the source, every weight within half a step, the rest the source's bf16) is
  ``test_the_int8_reference_is_the_source_rounded_per_channel``: the NxDI class and any reader of the
  same rank files agree on wrong int8 values (a scale of ``absmax/128``, every TP rank given rank 0's
  scale rows: both passed the lane when g4's ``NeuronEmulator`` was the reference); that test fails on them;
- ``int8_tp2``: ``g4convert int8-neuron --tp 2`` at TP 2, one process per rank (run after ``chat_tp2`` in
  the same two processes), each rank given a copy of the result that holds only its own rank file
  (NxDI's Route 2: pre-sharded files loaded as they are); both ranks against the int8 reference on
  the same result, tolerance ``TOL``; the ``engine`` case (g4serve's ``NeuronEngine`` on the TP-1
  result) and ``int8_bf16`` (below) against ``int8``'s reference;
- ``int8_tp_mismatch``: the TP-2 result at TP 1, which must be refused with a clear error;
- ``batch``: g4serve's ``NeuronEngine`` at ``max_batch_size`` 2 and 4 (NxDI's continuous batching:
  ``is_continuous_batching``, B KV cache lines) on ``g4convert int8-neuron --tp 1`` of the embedded
  model with ``sliding_window = 4`` in its config, :data:`BATCH_REQUESTS` (six prompts, 2 to 12
  new tokens) in six threads at once: each against the int8 reference on its own prompt
  (``TOL``) and the batch-1 engine; the token-generation calls' rows and shapes; two HTTP chat
  requests at once against the same two one after the other;
- ``long``: g4serve's ``NeuronEngine`` on ``g4convert int8-neuron --tp 1 --seq-len 160
  --max-context-length 32`` of the window-4 source: one context-encoding call of 32 positions, then
  token generation to position 159 on a full-layer cache of 160 positions, against the int8 reference
  (``TOL``); a prompt of 33 tokens refused by the engine and the server;
- ``synth_heads``: a random fp32 checkpoint built here with transformers 5.24 (``tests/tiny.py:
  build_with_geometry_of``) with the real 26B-A4B attention geometry (``g4.convert.synth.GEMMA4_26B_A4B``:
  16 query heads, sliding head_dim 256 / 8 KV heads, full global_head_dim 512 / 2 KV heads with k_eq_v,
  proportional RoPE with partial_rotary_factor 0.25 on full layers, softcap 30) and the rest shrunk
  (``SYNTH``: hidden 256, layers S S S F, 8 experts top-2, vocab 512, sliding_window 8 < the 31
  positions, ``layer_scalar`` 0.5 / 0.8 / 1.1 / 1.4), text-only layout, greedy from fixed random
  ids (``SYNTH_PROMPT_LEN``, seeded: no tokenizer); ``synth_heads_tp2`` the same at TP 2, where the
  full layers' 2 KV heads are split (1 per rank), not replicated;
- ``defaults``: a checkpoint like ``synth_heads`` (without k_eq_v, seed 1) whose config.json then
  leaves out every key Gemma 4 has a default for (:data:`OPTIONAL_KEYS`: ``global_head_dim``, 512
  by default, twice the sliding ``head_dim``; ``num_global_key_value_heads``; ``attention_k_eq_v``;
  ``tie_word_embeddings``; ``layer_types``): the class (reading g4's one config reader) against
  transformers reading the same file; ``defaults_int8`` its ``g4convert int8-neuron --tp 1`` result
  against the int8 reference (transformers reading the source's config.json, which lacks those keys),
  and g4's ``NeuronEmulator``'s and the class's geometry against
  ``g4.core.gemma4.read_architecture`` (``test_a_config_without_its_optional_keys_is_read_alike``);
- ``rope_first_dims`` (negative control): NxDI with the full layers' ``partial_rotary_factor`` set to
  1.0 (every frequency non-zero, the shape of PR #172's mistake) against the unchanged reference: the
  logits must move by far more than the tolerance.

Tolerance: max |logit difference| over all steps and the whole vocabulary ``1e-4`` (fp32; logits
reach about 15, measured differences are a few 1e-6 on the embedded model; on ``synth_heads`` 2-3e-5, the
size of fp32 rounding there: transformers' own fp32 logits differ from its fp64 ones by as much). The
int8 cases keep it: their reference holds the same dequantized weights in fp32, so what remains is
fp32 rounding of the same products in another order (NxD: ``(x @ q.T) * scale``), measured 3.8e-6
(``int8``, ``engine``), 3.3e-6 (``int8_tp2``, both ranks), 2.4e-5 (``defaults_int8``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import free_ports, wait_workers
import torch

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO.parent / "shared" / "vendor"
NXD_SRC = Path(os.environ.get("G4_NXD_SRC", VENDOR / "neuronx-distributed-v2.28.0" / "src"))
NXDI_SRC = Path(os.environ.get("G4_NXDI_SRC", VENDOR / "neuronx-distributed-inference-v0.8.0" / "src"))
OVERLAY = Path(os.environ.get("G4_NXDI_OVERLAY", REPO / ".venv-nxdi" / "tf457"))
WORKER = Path(__file__).resolve().parent / "nxd_cpu" / "nxdi_worker.py"
# the workers' whole run: about 12 s at TP 2 and 20 s at TP 1 on 2 cores; a worker still running 40 s
# before it dumps its threads' stacks into its log and exits (LANE_HANG_S, nxdi_worker.py)
WORKER_TIMEOUT_S = 240
TOL, TOL_BF16 = 1e-4, 0.25
SPEC_TPS = {"embedded": [1, 2, 4], "26B-A4B": [2, 4, 8]}
# synth_heads: the 26B-A4B config with everything but its attention geometry shrunk
SYNTH = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 64,
         "num_experts": 8, "top_k_experts": 2, "vocab_size": 512, "vocab_size_per_layer_input": 512,
         "sliding_window": 8}
SYNTH_PROMPT_LEN = 20
# defaults: the text-config keys Gemma 4 has a default for (transformers 5.24, Gemma4TextConfig),
# left out of its config.json
OPTIONAL_KEYS = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "tie_word_embeddings",
                 "layer_types")
NEW_TOKENS, SEQ_LEN = 12, 32
# long: KV cache length and longest prompt (g4convert int8-neuron --seq-len / --max-context-length)
LONG_SEQ_LEN, LONG_PROMPT = 160, 32
# batch: (question, new tokens) per request, more requests than the larger batch size
BATCH_REQUESTS = (("What is the capital of France?", 12), ("What is the capital of Japan?", 4),
                  ("What is the capital of Italy?", 9), ("What is the largest planet in the solar system?", 12),
                  ("What is 2+2?", 2), ("The opposite of hot is", 7))
BATCH_SIZES = (2, 4)
QUESTION = "What is the capital of France?"
WINDOW_QUESTION = "What is the largest planet in the solar system?"  # the window4 case's prompt
# the HTTP batching case's two requests (in BATCH_REQUESTS): prompts the window-4 model answers with
# a word and a stop, so each needs a token-generation step (most others it answers with a stop at once)
HTTP_QUESTIONS = ("What is 2+2?", "The opposite of hot is")
OVERLAY_PACKAGES = ["transformers==4.57.*", "huggingface-hub<1.0", "tokenizers>=0.22,<=0.23", "requests", "fsspec",
                    "scipy"]


def _missing() -> str | None:
    if not (NXD_SRC / "neuronx_distributed" / "modules" / "moe" / "expert_mlps_v2.py").is_file():
        return (f"neuronx-distributed v2.28.0 source not found at {NXD_SRC} (set G4_NXD_SRC to the src/ folder "
                "of aws-neuron/neuronx-distributed@v2.28.0; the PyPI package is a placeholder)")
    if not (NXDI_SRC / "neuronx_distributed_inference" / "models" / "model_base.py").is_file():
        return (f"neuronx-distributed-inference 0.8.0 source not found at {NXDI_SRC} (set G4_NXDI_SRC to the src/ "
                "folder of aws-neuron/neuronx-distributed-inference at its Neuron SDK 2.28.0 release)")
    return None


pytestmark = [pytest.mark.nxd_cpu, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


def _overlay() -> Path:
    """transformers 4.57 for NxDI, built once (atomically) where it is absent."""
    if (OVERLAY / "transformers" / "__init__.py").is_file():
        return OVERLAY
    OVERLAY.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tf457-", dir=OVERLAY.parent))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                        *OVERLAY_PACKAGES], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"cannot build the transformers 4.57 overlay NxDI 0.8 needs at {OVERLAY}: {r.stderr[-500:]}")
    try:
        tmp.rename(OVERLAY)
    except OSError:  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return OVERLAY


def _long_text_ids(n: int) -> list[int]:
    """``n`` ids of English text (the embedded model's questions and answers, in turn) in the embedded
    tokenizer: what the ``long`` case feeds its decode, so every step reads a varied context."""
    from transformers import AutoTokenizer

    from g4.convert.resolve import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    text = " ".join(f"{q} {a}." for q, a in ((QUESTION, "Paris"), (WINDOW_QUESTION, "Jupiter"),
                                             ("What is the capital of Japan?", "Tokyo")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def _chat_ids(question: str) -> list[int]:
    from transformers import AutoTokenizer

    from g4.convert.resolve import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


@torch.no_grad()
def _reference(prompt: list[int], sliding_window: int | None = None, model_dir: Path | None = None
               ) -> tuple[list[int], torch.Tensor]:
    """transformers 5.24, fp32, greedy with its own KV cache: tokens and raw logits per step, on
    ``model_dir`` (default the embedded model; multimodal or text-only layout)."""
    from transformers import AutoConfig, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    from g4.convert.resolve import EMBEDDED_DIR

    model_dir = model_dir or EMBEDDED_DIR
    config = AutoConfig.from_pretrained(model_dir)
    multimodal = hasattr(config, "text_config")
    if sliding_window is not None:
        (config.text_config if multimodal else config).sliding_window = sliding_window
    cls = Gemma4ForConditionalGeneration if multimodal else Gemma4ForCausalLM
    model = cls.from_pretrained(model_dir, config=config, dtype=torch.float32, experts_implementation="eager").eval()
    return _greedy(model, prompt)


def _greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS, forced: list[int] | None = None
            ) -> tuple[list[int], torch.Tensor]:
    """``new_tokens`` greedy steps of a transformers causal LM on its own KV cache: the ids (each
    step's argmax) and the raw logits per step, fp32 ``[new_tokens, V]``; with ``forced``, step i
    is fed ``forced[i]`` instead of its argmax (teacher forcing)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for i in range(new_tokens):
        step = out.logits[0, -1].float()
        tokens.append(int(step.argmax()))
        logits.append(step)
        fed = forced[i] if forced and i < len(forced) else tokens[-1]
        out = model(torch.tensor([[fed]]), cache=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


# ---------------------------------------------- the int8 reference: the rank files read by the test alone
# How NxD cuts a full tensor for TP rank r (aws-neuron/neuronx-distributed v2.28.0
# src/neuronx_distributed/trace/trace.py, create_local_weight): split along the partition dim into
# pieces of (per-rank size / stride), rank r takes pieces r, r + T, r + 2T, ... Per rank-file name
# (relative to the layer or the model): (partition dim, stride) in NxD's own layout; the partition
# dims are NxD's layers' (parallel_layers/layers.py: ColumnParallelLinear weight [out/T, in] on dim 0,
# RowParallelLinear [out, in/T] on dim 1, ParallelEmbedding with shard_across_embedding [V, H/T] on
# dim 1; modules/moe/moe_parallel_layers.py: ExpertFusedColumnParallelLinear [E, H, 2I/T] on dim 2,
# with stride 2 for the fused [gate | up], ExpertFusedRowParallelLinear [E, I/T, H] on dim 1). A
# per-channel int8 scale is cut with its weight only where its channel axis is the partition dim
# (quantization/quantization_layers.py, _setup_for_scale): column parallel yes, row parallel no.
# Names not listed here are replicated (norms, router, layer_scalar, row-parallel scales).
NXD_PARTITION = {
    "self_attn.q_proj.weight": (0, 1), "self_attn.k_proj.weight": (0, 1), "self_attn.v_proj.weight": (0, 1),
    "self_attn.o_proj.weight": (1, 1),
    "mlp.gate_proj.weight": (0, 1), "mlp.gate_proj.scale": (0, 1), "mlp.up_proj.weight": (0, 1),
    "mlp.up_proj.scale": (0, 1), "mlp.down_proj.weight": (1, 1),
    "moe.expert_mlps.mlp_op.gate_up_proj.weight": (2, 2), "moe.expert_mlps.mlp_op.gate_up_proj.scale": (2, 2),
    "moe.expert_mlps.mlp_op.down_proj.weight": (1, 1),
    "embed_tokens.weight": (1, 1), "lm_head.weight": (0, 1), "lm_head.scale": (0, 1),
}
# NxD's fused experts stored [E, in, out] (x @ W); transformers' Gemma 4 keeps [E, out, in]
NXD_EXPERTS = {"moe.expert_mlps.mlp_op.gate_up_proj": "experts.gate_up_proj",
               "moe.expert_mlps.mlp_op.down_proj": "experts.down_proj"}
NXD_RANK_INDICES = ("rank_util.rank", ".spmd_rank.rank")  # NxD's SPMD rank parameters: no weight


def _nxd_unpartition(parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The inverse of NxD's ``create_local_weight``: every TP rank's tensor (rank order, each with
    ``stride`` pieces along ``dim``) back to the full tensor, whose piece k is rank ``k % T``'s piece
    ``k // T``."""
    pieces = [p.chunk(stride, dim) for p in parts]
    return torch.cat([pieces[k % len(parts)][k // len(parts)] for k in range(stride * len(parts))], dim)


def _hf_name(name: str) -> str:
    """A rank-file name (NxDI class, relative to the text model) as transformers'
    ``Gemma4ForCausalLM`` names it."""
    if name.startswith("lm_head."):
        return name
    for nxd, hf in NXD_EXPERTS.items():
        if name.endswith(nxd + ".weight"):
            return "model." + name[: -len(nxd + ".weight")] + hf
    return "model." + name.replace(".moe.router.", ".router.")


def _int8_reference_weights(out_dir: Path, model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The int8-neuron result ``out_dir`` as a transformers ``Gemma4ForCausalLM`` state dict, read
    here with safetensors and plain torch (none of g4's code): every rank file
    (``manifest.json``'s ``rank_files``) reassembled by NxD's partitioning (:data:`NXD_PARTITION`),
    each int8 ``weight`` times its fp32 per-channel ``scale`` (``[out, 1]``; the experts'
    ``[E, 1, out]`` in NxD's ``[E, in, out]``, transposed to ``[E, out, in]``), fp32; kept bf16
    tensors as fp32; a replicated tensor must be the same on every TP rank. k/v rows NxDI repeated
    per rank (fewer KV heads than ranks: NxDI's GQA ``REPLICATE_TO_TP_DEGREE`` repeats each head,
    ``modules/attention/gqa.py``) must be equal copies and come back once, to ``model``'s shapes.

    Returns:
        (the state dict, fp32; per int8 tensor under the same name its scale ``[..., out, 1]``
        in transformers' layout).
    """
    from safetensors.torch import load_file

    manifest = json.loads((out_dir / "manifest.json").read_text())
    ranks = [load_file(out_dir / f) for f in manifest["rank_files"]]
    assert manifest["rank_files"] == [f"weights/tp{r}_sharded_checkpoint.safetensors" for r in range(len(ranks))]
    full = {}
    for name in ranks[0]:
        parts = [rank[name] for rank in ranks]
        if name.endswith(NXD_RANK_INDICES):
            assert [p.tolist() for p in parts] == [[r] for r in range(len(ranks))], name
            continue
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        if short in NXD_PARTITION:
            full[name] = _nxd_unpartition(parts, *NXD_PARTITION[short])
        else:
            assert all(torch.equal(p, parts[0]) for p in parts), f"{name}: replicated, yet not the same on every rank"
            full[name] = parts[0]
    target = model.state_dict()
    weights, scales = {}, {}
    for name, t in full.items():
        owner = full.get(name[: -len(".scale")] + ".weight") if name.endswith(".scale") else None
        if owner is not None and owner.dtype == torch.int8:
            continue  # an int8 weight's per-channel scale, taken with it
        hf = _hf_name(name)
        scale = full.get(name[: -len(".weight")] + ".scale") if t.dtype == torch.int8 else None
        w = t.float() if scale is None else t.float() * scale  # int8 * per-output-channel fp32 scale
        if hf.endswith(tuple(NXD_EXPERTS.values())):
            w, scale = w.transpose(1, 2), None if scale is None else scale.transpose(1, 2)
        if w.shape != target[hf].shape and hf.endswith(("k_proj.weight", "v_proj.weight")):
            layer = int(name.split(".")[1])
            hd = model.model.layers[layer].self_attn.head_dim
            copies = w.view(target[hf].shape[0] // hd, -1, hd, w.shape[1])  # [kv heads, copies, hd, H]
            assert (copies == copies[:, :1]).all(), f"{name}: NxDI's repeated KV head rows differ"
            w = copies[:, 0].reshape(target[hf].shape)
        weights[hf] = w.contiguous()
        if scale is not None:
            scales[hf] = scale
    return weights, scales


def _source_state_dict(source_dir: Path) -> dict[str, torch.Tensor]:
    """The source checkpoint's text-model tensors as stored (bf16 or fp32), under transformers'
    ``Gemma4ForCausalLM`` names (multimodal ``model.language_model.*`` or text-only ``model.*``),
    read with safetensors; a tied lm_head is the embedding."""
    from safetensors.torch import load_file

    raw = {k: v for f in sorted(source_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in raw) else "model."
    out = {"model." + k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    out["lm_head.weight"] = raw.get("lm_head.weight", out["model.embed_tokens.weight"])
    return out


@torch.no_grad()
def _int8_reference(out_dir: Path, source_dir: Path, prompt: list[int], new_tokens: int = NEW_TOKENS,
                    forced: list[int] | None = None
                    ) -> tuple[list[int], torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """transformers' ``Gemma4ForCausalLM`` in fp32, built from the source checkpoint's config (the
    text config, with ``tie_word_embeddings`` off: the int8 lm_head is not the bf16 embedding)
    and loaded (every parameter and buffer, strictly) with the int8-neuron result's rank files as
    :func:`_int8_reference_weights` reads them (the embedding: the rank files' device shards, as
    the NxDI class holds it); greedy on its own KV cache like :func:`_reference`. transformers
    scales the looked-up rows by ``sqrt(H)`` in fp32, as the NxDI class in fp32 does (the
    int8-neuron runtime's ``bf16(sqrt(H))`` on the host would move the logits by up to 5e-3).

    Returns:
        ids, fp32 logits ``[new_tokens, V]``, the state dict and the int8 tensors' scales.
    """
    from transformers import AutoConfig, Gemma4ForCausalLM

    config = AutoConfig.from_pretrained(source_dir).get_text_config()
    config.tie_word_embeddings = False
    model = Gemma4ForCausalLM._from_config(config, dtype=torch.float32, experts_implementation="eager")
    weights, scales = _int8_reference_weights(out_dir, model)
    model.load_state_dict(weights)  # strict: every parameter and persistent buffer, nothing else
    return (*_greedy(model.eval(), prompt, new_tokens, forced), weights, scales)


@pytest.fixture(scope="module")
def lane(tmp_path_factory):
    t_overlay = time.perf_counter()
    overlay = _overlay()  # once per checkout; not part of the lane's budget
    t0 = time.perf_counter()
    from g4.convert.resolve import EMBEDDED_DIR

    base = tmp_path_factory.mktemp("nxdi_gemma4")
    chat, other = _chat_ids(QUESTION), _chat_ids(WINDOW_QUESTION)
    full_rope = json.loads((EMBEDDED_DIR / "config.json").read_text())["text_config"]["rope_parameters"]
    full_rope = dict(full_rope, full_attention=dict(full_rope["full_attention"], partial_rotary_factor=1.0))
    from g4.convert.synth import GEMMA4_26B_A4B
    from tiny import build_with_geometry_of

    synth = build_with_geometry_of(base / "synth_heads", GEMMA4_26B_A4B, seed=0, **SYNTH)
    defaults = _without_optional_keys(build_with_geometry_of(base / "defaults", GEMMA4_26B_A4B, seed=1,
                                                             **SYNTH, attention_k_eq_v=False))
    synth_prompt = torch.randint(3, SYNTH["vocab_size"], (SYNTH_PROMPT_LEN,),
                                 generator=torch.Generator().manual_seed(0)).tolist()
    from g4.convert.int8_neuron import convert_int8_neuron

    int8_dirs = {tp: convert_int8_neuron(EMBEDDED_DIR, base / f"int8-tp{tp}", tp=tp, quantize_attention=False,
                                         target="inf2.xlarge", progress=False, seq_len=SEQ_LEN).out for tp in (1, 2)}
    defaults_int8 = convert_int8_neuron(defaults, base / "defaults-int8", tp=1, quantize_attention=False,
                                        target="inf2.xlarge", progress=False, seq_len=SEQ_LEN).out
    cases = {"chat": (chat, {}, 1), "window4": (other, {"sliding_window": 4}, 1),
             "window4_tp2": (other, {"sliding_window": 4}, 2),
             "rope_first_dims": (chat, {"rope_parameters": full_rope}, 1), "chat_tp2": (chat, {}, 2),
             "chat_bf16": (chat, {}, 1), "int8": (chat, {}, 1), "int8_bf16": (chat, {}, 1), "int8_tp2": (chat, {}, 2),
             "int8_tp_mismatch": (chat, {}, 1), "synth_heads": (synth_prompt, {}, 1),
             "synth_heads_tp2": (synth_prompt, {}, 2), "defaults": (synth_prompt, {}, 1),
             "defaults_int8": (synth_prompt, {}, 1)}
    models = {"int8": int8_dirs[1], "int8_bf16": int8_dirs[1], "int8_tp2": int8_dirs[2], "int8_tp_mismatch": int8_dirs[2],
              "synth_heads": synth, "synth_heads_tp2": synth, "defaults": defaults, "defaults_int8": defaults_int8}
    jobs = {}
    for name, (prompt, overrides, tp) in cases.items():
        jobs[name] = {"nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "prompt": prompt,
                      "quantized": "int8" in name, "model": str(models.get(name, EMBEDDED_DIR)),
                      "new_tokens": NEW_TOKENS, "seq_len": SEQ_LEN,
                      "dtype": "bfloat16" if name.endswith("bf16") else "float32",
                      "overrides": overrides, "tp": tp, "result": str(base / f"{name}.pt")}
    # each rank of int8_tp2 sees a copy of the result that holds only its own rank file (Route 2)
    jobs["int8_tp2"]["model_per_rank"] = [str(_rank_view(int8_dirs[2], rank, base / f"int8-tp2-rank{rank}"))
                                          for rank in range(2)]
    jobs["engine"] = {"kind": "engine", "nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "prompt": chat,
                      "question": QUESTION, "model": str(int8_dirs[1]), "new_tokens": NEW_TOKENS, "tp": 1,
                      "result": str(base / "engine.pt")}
    # g4serve's NeuronEngine at --max-batch-size 2 and 4 (NxDI's continuous batching) on the int8
    # result of the embedded model with sliding_window 4 (each KV cache line's sliding layers a ring)
    window_src = shutil.copytree(EMBEDDED_DIR, base / "window4-src")
    config = json.loads((window_src / "config.json").read_text())
    config["text_config"]["sliding_window"] = 4
    (window_src / "config.json").write_text(json.dumps(config, indent=2))
    batch_int8 = convert_int8_neuron(window_src, base / "batch-int8", tp=1, quantize_attention=False,
                                     target="inf2.xlarge", progress=False, seq_len=SEQ_LEN).out
    # long: the same source converted for LONG_SEQ_LEN tokens with prompts of at most LONG_PROMPT (the one
    # context-encoding shape of NxDI's CPU mode), decoded by the engine to the end of its KV cache
    long_int8 = convert_int8_neuron(window_src, base / "long-int8", tp=1, quantize_attention=False,
                                    target="inf2.xlarge", progress=False, seq_len=LONG_SEQ_LEN,
                                    max_context_length=LONG_PROMPT).out
    long_tokens = LONG_SEQ_LEN - len(other)
    long_forced = _long_text_ids(long_tokens - 1)
    jobs["long"] = {"kind": "engine", "nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "prompt": other,
                    "question": WINDOW_QUESTION, "model": str(long_int8), "new_tokens": long_tokens, "tp": 1,
                    "forced": long_forced, "result": str(base / "long.pt")}
    batch_prompts = [[_chat_ids(q), n] for q, n in BATCH_REQUESTS]
    jobs["batch"] = {"kind": "batch", "nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "model": str(batch_int8),
                     "batch_sizes": list(BATCH_SIZES), "prompts": batch_prompts,
                     "questions": list(HTTP_QUESTIONS), "tp": 1, "result": str(base / "batch.pt")}
    # last in the TP-1 process: the int8 class's state_dict() at bf16 on the meta device, embedded and 26B-A4B
    (base / "26b").mkdir()
    (base / "26b" / "config.json").write_text(json.dumps(GEMMA4_26B_A4B))
    jobs["specs"] = {"kind": "specs", "nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "tp": 1,
                     "configs": {"embedded": str(EMBEDDED_DIR), "26B-A4B": str(base / "26b")},
                     "tps": SPEC_TPS, "result": str(base / "specs.pt")}
    # after specs in the TP-1 process: what load_weights hands nxd_model.initialize on Neuron, at TP 1,
    # 2 and 4 (at 4 every KV head is replicated on two ranks; no generation runs at TP 4)
    route2_dirs = {str(tp): str(d) for tp, d in int8_dirs.items()}
    route2_dirs["4"] = str(convert_int8_neuron(EMBEDDED_DIR, base / "int8-tp4", tp=4, quantize_attention=False,
                                               target="inf2.48xlarge", progress=False, seq_len=SEQ_LEN).out)
    jobs["route2"] = {"kind": "route2", "nxd_src": str(NXD_SRC), "nxdi_src": str(NXDI_SRC), "tp": 1,
                      "results": route2_dirs, "scratch": str(base), "result": str(base / "route2.pt")}
    # a gloo rendezvous port for each TP-2 job (run one after the other by the same two processes) and one
    # for each group, all distinct and outside the ports the kernel hands out (helpers.free_ports)
    tp2_jobs = ("chat_tp2", "window4_tp2", "int8_tp2", "synth_heads_tp2")
    ports = free_ports(len(tp2_jobs) + 2)
    for name, port in zip(tp2_jobs, ports):
        jobs[name]["master_port"] = port
    # every TP-1 case in one process (NxDI imported once), the TP-2 cases in one process per rank
    groups = {"tp1": ([j for j in jobs.values() if j["tp"] == 1], 1),
              "tp2": ([j for j in jobs.values() if j["tp"] == 2], 2)}
    procs = []
    for (group, (payload, world)), port in zip(groups.items(), ports[len(tp2_jobs):]):
        (base / f"{group}.json").write_text(json.dumps(payload))
        for rank in range(world):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), os.environ.get("PYTHONPATH", "")]),
                       OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       LANE_HANG_S=str(WORKER_TIMEOUT_S - 40))
            env.pop("WORLD_SIZE", None)
            if world > 1:  # what torchrun would set; NxDI's to_cpu opens the gloo group from them
                env.update(RANK=str(rank), WORLD_SIZE=str(world))
            log = open(base / f"{group}.rank{rank}.log", "w")
            procs.append((group, rank, log, subprocess.Popen(
                [sys.executable, str(WORKER), str(base / f"{group}.json")], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT)))
    # the int8 cases' references: (result, its source checkpoint, prompt)
    int8_sources = {"int8": (int8_dirs[1], EMBEDDED_DIR, chat), "int8_tp2": (int8_dirs[2], EMBEDDED_DIR, chat),
                    "defaults_int8": (defaults_int8, defaults, synth_prompt)}
    int8_sources.update({f"batch/{i}": (batch_int8, window_src, prompt) for i, (prompt, _) in enumerate(batch_prompts)})
    int8_sources["long"] = (long_int8, window_src, other)
    ref_tokens = {"long": long_tokens}  # new tokens of a reference when not NEW_TOKENS
    ref_forced = {"long": long_forced}
    # the references run beside the workers on the same cores: one thread, as the workers have
    # (OMP_NUM_THREADS=1); torch's default of one thread per core made them 20-100x slower there
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = {"chat": _reference(chat), "window4": _reference(other, sliding_window=4)}
        refs["rope_first_dims"] = refs["chat_tp2"] = refs["chat_bf16"] = refs["chat"]
        refs["window4_tp2"] = refs["window4"]
        refs["synth_heads"] = refs["synth_heads_tp2"] = _reference(synth_prompt, model_dir=synth)
        refs["defaults"] = _reference(synth_prompt, model_dir=defaults)
        int8_refs = {}  # case: the int8 reference's state dict and scales, and the source they came from
        for name, (out, source, prompt) in int8_sources.items():
            tokens, logits, weights, scales = _int8_reference(out, source, prompt, ref_tokens.get(name, NEW_TOKENS),
                                                              ref_forced.get(name))
            refs[name] = tokens, logits
            int8_refs[name] = {"weights": weights, "scales": scales, "source": source, "out": out}
        refs["engine"] = refs["int8_bf16"] = refs["int8"]
        # the same checkpoint with a window as wide as the sequence: the reference's first step moves
        refs["synth_full_window"] = _reference(synth_prompt, sliding_window=SEQ_LEN, model_dir=synth)
    finally:
        torch.set_num_threads(threads)
    failures = wait_workers([(f"{group} rank {rank}", base / f"{group}.rank{rank}.log", p)
                             for group, rank, _, p in procs], WORKER_TIMEOUT_S)
    for *_, log, _ in procs:
        log.close()
    assert not failures, "\n\n".join(failures)
    found = {}
    for name, job in jobs.items():
        for rank in range(job["tp"]):
            r = torch.load(base / (f"{name}.pt.rank{rank}" if job["tp"] > 1 else f"{name}.pt"), weights_only=False)
            if name in ("int8_tp_mismatch", "specs", "route2"):  # not a generation (the first is meant to fail)
                assert name == "int8_tp_mismatch" or "error" not in r, (name, r["error"], r["where"])
                found[name] = r
                continue
            if name == "batch":  # several generations: each request's reference is refs["batch/<i>"]
                assert "error" not in r, (name, r["error"], r["where"])
                r["ref"] = [refs[f"batch/{i}"] for i in range(len(batch_prompts))]
                found[name] = r
                continue
            assert "error" not in r, (name, rank, r["error"], r["where"])
            r["ref_tokens"], r["ref_logits"] = refs[name]
            found[name if rank == 0 else f"{name}/rank{rank}"] = r
    found["synth_full_window"] = refs["synth_full_window"]
    found["int8_reference"] = int8_refs
    found["route2_dirs"] = route2_dirs
    found["synth_config"], found["synth_dir"] = json.loads((synth / "config.json").read_text()), str(synth)
    found["defaults_dir"], found["defaults_int8_dir"] = defaults, defaults_int8
    found["wall_s"] = time.perf_counter() - t0
    found["overlay_s"] = t0 - t_overlay
    print("nxdi_gemma4 max |logit diff| vs reference: " + ", ".join(
        f"{n}: {(r['logits'] - r['ref_logits']).abs().max().item():.2g} (ids equal: {r['tokens'] == r['ref_tokens']})"
        for n, r in found.items() if isinstance(r, dict) and "logits" in r))
    print(f"nxdi_gemma4 lane: {found['wall_s']:.1f} s (overlay {found['overlay_s']:.1f} s); " + ", ".join(
        f"{n}: worker {found[n]['wall_s']:.1f} s (imports {found[n]['t_import']:.1f}, load {found[n]['t_load']:.1f}, "
        f"generate {found[n]['t_gen']:.1f})" for n in [*cases, "engine", "long"] if "t_gen" in found[n]))
    print("nxdi_gemma4 batch: " + ", ".join(
        f"B={b}: {len(found['batch'][b]['decode_batches'])} token-generation calls for "
        f"{sum(found['batch'][b]['decode_batches'])} steps (rows {found['batch'][b]['decode_batches']})"
        for b in BATCH_SIZES) + f"; worker {found['batch']['wall_s']:.1f} s")
    return found


def _without_optional_keys(model_dir: Path) -> Path:
    """``model_dir`` with :data:`OPTIONAL_KEYS` deleted from its config.json's text config."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    tc = config.get("text_config", config)
    assert tc.get("global_head_dim") == 2 * tc["head_dim"] and not tc.get("attention_k_eq_v")
    for key in OPTIONAL_KEYS:
        tc.pop(key, None)
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def _rank_view(out: Path, rank: int, view: Path) -> Path:
    """A directory that is ``out`` (symlinks) without the other ranks' weight files: rank ``rank``
    can read only ``weights/tp{rank}_sharded_checkpoint.safetensors``."""
    from g4.exporters.neuron_int8 import WEIGHTS_DIR, rank_file

    view.mkdir()
    for item in out.iterdir():
        if item.name != WEIGHTS_DIR:
            (view / item.name).symlink_to(item)
    (view / WEIGHTS_DIR).mkdir()
    (view / rank_file(rank)).symlink_to(out / rank_file(rank))
    return view



@pytest.mark.parametrize("case", ["chat", "window4", "window4_tp2", "window4_tp2/rank1", "chat_tp2", "chat_tp2/rank1",
                                  "int8", "int8_tp2", "int8_tp2/rank1", "synth_heads", "synth_heads_tp2", "synth_heads_tp2/rank1",
                                  "defaults", "defaults_int8"])
def test_greedy_ids_and_logits_match_transformers(lane, case):
    r = lane[case]
    diff = (r["logits"] - r["ref_logits"]).abs().max().item()
    assert r["tokens"] == r["ref_tokens"], (r["tokens"], r["ref_tokens"])
    assert len(r["tokens"]) == NEW_TOKENS
    assert diff < TOL, f"{case}: max |logit difference| {diff:.3g} over {NEW_TOKENS} steps"
    assert r["logits"].abs().max() > 5  # not a degenerate comparison


def test_bf16_weights_give_the_fp32_reference_ids_within_bf16_rounding(lane):
    """The class in bf16 (NxDI casts the checkpoint to ``torch_dtype``) against transformers in fp32:
    same greedy ids over all ``NEW_TOKENS`` steps, and over the reply's steps (up to its first stop
    id, which the model was trained to produce) logits within ``TOL_BF16`` (bf16's spacing at |logit|
    8-16 is 0.0625). Past the stop the model runs on text it never saw and bf16's error grows: 0.63
    there with the model that calls a tool, where transformers' own bf16 run differed from its fp32
    run by up to 1.04 at one step with the model before it."""
    from g4.convert.embedded_model import EOS_TOKEN_IDS

    r = lane["chat_bf16"]
    assert r["tokens"] == r["ref_tokens"]
    stops = [i for i, t in enumerate(r["ref_tokens"]) if t in EOS_TOKEN_IDS]
    reply = stops[0] + 1 if stops else len(r["ref_tokens"])
    diff = (r["logits"][:reply] - r["ref_logits"][:reply]).abs().max().item()
    assert diff < TOL_BF16, diff


@pytest.mark.parametrize("case", ["chat_bf16", "int8_bf16"])
def test_bf16_embedding_is_transformers_scaled_embedding_bit_for_bit(lane, case):
    """The class's embedding output in bf16 (context encoding, the prompt's rows) equals
    transformers' ``Gemma4TextScaledWordEmbedding`` of the source in bf16, bit for bit: the table
    times ``sqrt(hidden_size)`` rounded to bf16 (case P12). The embedded model's hidden size, 128,
    is not a perfect square, so the unrounded constant (11.3137 for bf16's 11.3125) changes about 3%
    of the elements; the logits move by less than bf16 noise, so only this check sees it."""
    from transformers import Gemma4ForConditionalGeneration

    from g4.convert.resolve import EMBEDDED_DIR

    r = lane[case]
    model = Gemma4ForConditionalGeneration.from_pretrained(EMBEDDED_DIR, dtype=torch.bfloat16).eval()
    emb = model.model.language_model.embed_tokens
    hidden = emb.weight.shape[1]
    assert round(hidden**0.5) ** 2 != hidden and float(torch.tensor(hidden**0.5).bfloat16()) != hidden**0.5
    with torch.no_grad():
        want = emb(torch.tensor([_chat_ids(QUESTION)]))
    got = r["embeds"][:, : want.shape[1]]
    assert got.dtype == want.dtype == torch.bfloat16
    differ = (got != want).sum().item()
    assert differ == 0, f"{case}: {differ} of {want.numel()} embedding elements differ from transformers'"


def test_the_window_case_differs_from_the_full_window(lane):
    """window 4 changes the answer, so the windowed mask really took part in both runs; and the
    ``window4`` cases (TP 1 and 2) run at least 3 windows past the window: position 30 with a window
    of 4, its ring of 3 slots overwritten several times over in token generation (``synth_heads``,
    window 8, reaches position 30 too, at TP 1 and 2)."""
    assert len(_chat_ids(WINDOW_QUESTION)) + NEW_TOKENS - 1 >= 4 * 4
    assert lane["window4_tp2"]["ref_tokens"] == lane["window4"]["ref_tokens"]
    assert lane["window4"]["ref_tokens"] != lane["chat"]["ref_tokens"]
    assert (lane["window4"]["ref_logits"][0] - lane["chat"]["ref_logits"][0]).abs().max() > 1e-2


def test_the_comparison_catches_rope_on_the_wrong_dims(lane):
    r = lane["rope_first_dims"]
    assert (r["logits"] - r["ref_logits"]).abs().max().item() > 100 * TOL


def test_the_engine_ran_context_encoding_then_token_generation_on_the_kv_cache(lane):
    r = lane["chat"]
    assert r["transformers"].startswith("4.57")
    assert r["input_shapes"] == [[1, SEQ_LEN]] + [[1, 1]] * (NEW_TOKENS - 1)
    # per-layer cache shapes: [batch, KV heads, positions, head_dim], K and V per layer
    assert r["kv_shapes"] == [[1, 2, SEQ_LEN, 32]] * 6 + [[1, 1, SEQ_LEN, 64]] * 2


@pytest.mark.parametrize("case", ["chat", "window4", "window4_tp2", "window4_tp2/rank1", "chat_tp2", "chat_tp2/rank1",
                                  "chat_bf16", "synth_heads", "synth_heads_tp2", "synth_heads_tp2/rank1"])
def test_kv_cache_is_what_the_memory_plan_counts(lane, case):
    """The KV cache NxDI allocated for g4's class (every buffer's bytes, on each rank) is the memory
    plan's figure (``g4.convert.plan.kv_cache_nxdi``), and its per-layer shapes are the shared
    ``kv_cache_layers`` heads and head dims with, written out here, seq_len positions on a full
    layer and ``sliding_window - 1`` (at most seq_len) on a sliding one: all 32 for the shipped
    window of 64, 3 for ``window4``, 7 for ``synth_heads``."""
    from g4.core.gemma4 import kv_cache_layers, read_architecture
    from g4.convert.plan import kv_cache_nxdi
    from g4.convert.resolve import EMBEDDED_DIR

    r, tp = lane[case], 2 if "_tp2" in case else 1
    config = lane["synth_config"] if case.startswith("synth") else json.loads((EMBEDDED_DIR / "config.json").read_text())
    if case.startswith("window4"):
        config["text_config"]["sliding_window"] = 4
    arch = read_architecture(config)
    width = 2 if case == "chat_bf16" else 4
    assert r["kv_bytes"] == kv_cache_nxdi(arch, tp, SEQ_LEN, 1, dtype_bytes=width).total
    ring = min(arch.sliding_window - 1, SEQ_LEN)
    assert ring == {"window4": 3, "synth_heads": 7}.get(case.split("_tp2")[0], min(63, SEQ_LEN))
    assert r["kv_shapes"] == [[1, c.heads, ring if c.sliding else SEQ_LEN, c.head_dim]
                              for c in kv_cache_layers(arch.layers, tp) for _ in "kv"]


@pytest.mark.parametrize("case", ["chat", "chat_tp2", "chat_tp2/rank1", "int8", "int8_tp2", "int8_tp2/rank1",
                                  "synth_heads", "synth_heads_tp2", "synth_heads_tp2/rank1"])
def test_decode_takes_the_selective_loading_path(lane, case):
    """NxD's ExpertMLPsV2: context encoding (32 tokens x top-2 < block size 512) computes all experts;
    each decode step (1 x 2 / 8 experts < 1) only the chosen ones (forward_selective_loading)."""
    calls = lane[case]["expert_calls"]
    layers = 4
    assert calls[:layers] == [("forward_all_experts", SEQ_LEN)] * layers
    assert calls[layers:] == [("forward_selective_loading", 1)] * layers * (NEW_TOKENS - 1)


def test_tp2_splits_heads_and_experts_and_replicates_the_single_full_attention_kv_head(lane):
    """TP 2: query heads 4 -> 2 per rank, the sliding layers' 2 KV heads -> 1 per rank, the full
    layer's one KV head replicated to both ranks (as NxDI's GQA REPLICATE_TO_TP_DEGREE), experts'
    fused gate_up [E, H, 2I] -> [E, H, 2I/2] (NxD's stride-2 [gate_r | up_r]) and down [E, I/2, H]."""
    for case in ("chat_tp2", "chat_tp2/rank1"):
        r = lane[case]
        shapes = r["local_shapes"]
        assert shapes["layers.0.self_attn.q_proj.weight"] == [2 * 32, 128]
        assert shapes["layers.0.self_attn.k_proj.weight"] == [32, 128]
        assert shapes["layers.3.self_attn.q_proj.weight"] == [2 * 64, 128]
        assert shapes["layers.3.self_attn.k_proj.weight"] == [64, 128]
        assert "layers.3.self_attn.v_proj.weight" not in shapes  # k_eq_v
        assert shapes["layers.0.moe.expert_mlps.mlp_op.gate_up_proj.weight"] == [8, 128, 64]
        assert shapes["layers.0.moe.expert_mlps.mlp_op.down_proj.weight"] == [8, 32, 128]
        assert r["kv_shapes"] == [[1, 1, SEQ_LEN, 32]] * 6 + [[1, 1, SEQ_LEN, 64]] * 2
        assert (r["logits"] - lane["chat"]["logits"]).abs().max() < TOL


def test_a_config_without_its_optional_keys_is_read_alike(lane):
    """``defaults``' config.json has none of :data:`OPTIONAL_KEYS`; transformers, g4's reader, the
    NxDI class (its KV cache, its attention projections, with and without int8) and the
    ``NeuronEmulator`` build the same model from it: full layers with ``global_head_dim`` 512 (not
    the sliding 256), their own ``v_proj`` (no ``attention_k_eq_v``), the 5:1 layer pattern with the
    last layer full, a tied lm_head. The logits agree in ``test_greedy_ids_and_logits_match_transformers``."""
    from transformers import AutoConfig

    from g4.core.gemma4 import read_architecture
    from g4.serve.neuron_emulator import NeuronEmulator

    config = json.loads((lane["defaults_dir"] / "config.json").read_text())
    tc = config.get("text_config", config)
    assert not set(OPTIONAL_KEYS) & (set(tc) | set(config))
    arch = read_architecture(config)
    assert [(a.sliding, a.head_dim, a.has_v) for a in arch.layers] == [(True, 256, True)] * 3 + [(False, 512, True)]
    assert arch.tied and not arch.k_eq_v
    hf = AutoConfig.from_pretrained(lane["defaults_dir"])
    hf = getattr(hf, "text_config", hf)  # transformers 5.24 keeps per-layer sizes in per_layer_config
    assert [(hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads)
            for i in range(arch.num_layers)] == [(a.head_dim, a.kv_heads) for a in arch.layers]
    assert (hf.layer_types, hf.tie_word_embeddings, hf.attention_k_eq_v) == (arch.layer_types, True, False)
    # sliding layers: a ring of window - 1 = 7 positions
    kv = [shape for a in arch.layers for shape in [[1, a.kv_heads, 7 if a.sliding else SEQ_LEN, a.head_dim]] * 2]
    for case in ("defaults", "defaults_int8"):
        r = lane[case]
        assert r["kv_shapes"] == kv, case
        for layer, a in enumerate(arch.layers):
            shapes = r["local_shapes"]
            assert shapes[f"layers.{layer}.self_attn.q_proj.weight"] == [arch.heads * a.head_dim, arch.hidden], case
            assert shapes[f"layers.{layer}.self_attn.k_proj.weight"] == [a.kv_heads * a.head_dim, arch.hidden], case
            assert (f"layers.{layer}.self_attn.v_proj.weight" in shapes) == a.has_v, case
    emulator = NeuronEmulator(lane["defaults_int8_dir"])
    assert (emulator.geom.arch.layers, emulator.geom.arch.tied) == (arch.layers, arch.tied)


def test_synth_heads_has_the_26b_attention_geometry_and_exercises_it(lane):
    """``synth_heads`` is the 26B-A4B's attention as the real config gives it (every attention key of
    ``GEMMA4_26B_A4B`` unchanged but the window), in the class as in the checkpoint: KV cache
    ``[1, 8, 7, 256]`` on sliding (a ring of window - 1 positions) and ``[1, 2, S, 512]`` on full layers at TP 1; at TP 2 16 query heads
    -> 8 per rank, sliding KV 8 -> 4, full KV 2 -> 1 (split, not replicated); no ``v_proj`` on the
    full layer. The window is narrower than the sequence and changes the reference's answer, the
    ``layer_scalar`` values are not 1, and the greedy ids are not one repeated id."""
    from g4.convert.synth import GEMMA4_26B_A4B

    real, tc = GEMMA4_26B_A4B["text_config"], lane["synth_config"]
    for key in ("num_attention_heads", "head_dim", "global_head_dim", "num_key_value_heads",
                "num_global_key_value_heads", "attention_k_eq_v", "rope_parameters", "final_logit_softcapping"):
        assert tc[key] == real[key], key
    assert tc["layer_types"] == real["layer_types"][:3] + ["full_attention"]
    assert SYNTH_PROMPT_LEN > 2 * tc["sliding_window"]
    S = SEQ_LEN
    ring = tc["sliding_window"] - 1
    assert lane["synth_heads"]["kv_shapes"] == [[1, 8, ring, 256]] * 6 + [[1, 2, S, 512]] * 2
    for case in ("synth_heads_tp2", "synth_heads_tp2/rank1"):
        r = lane[case]
        assert r["kv_shapes"] == [[1, 4, ring, 256]] * 6 + [[1, 1, S, 512]] * 2
        shapes = r["local_shapes"]
        assert shapes["layers.0.self_attn.q_proj.weight"] == [8 * 256, 256]
        assert shapes["layers.0.self_attn.k_proj.weight"] == [4 * 256, 256]
        assert shapes["layers.3.self_attn.q_proj.weight"] == [8 * 512, 256]
        assert shapes["layers.3.self_attn.k_proj.weight"] == [512, 256]
        assert shapes["layers.3.self_attn.o_proj.weight"] == [256, 8 * 512]
        assert "layers.3.self_attn.v_proj.weight" not in shapes
        assert (r["logits"] - lane["synth_heads"]["logits"]).abs().max() < TOL
    ref_tokens, ref_logits = lane["synth_heads"]["ref_tokens"], lane["synth_heads"]["ref_logits"]
    _, wide_logits = lane["synth_full_window"]
    assert (wide_logits[0] - ref_logits[0]).abs().max() > 1
    assert len(set(ref_tokens)) >= 4, ref_tokens
    from safetensors import safe_open

    with safe_open(Path(lane["synth_dir"]) / "model.safetensors", "pt") as f:
        scalars = [f.get_tensor(f"model.layers.{i}.layer_scalar").item() for i in range(4)]
    assert len(set(scalars)) == 4 and 1.0 not in scalars, scalars


def test_int8_runs_on_nxd_int8_layers_with_g4_int8_neuron_weights(lane):
    """``g4convert int8-neuron --tp 1`` output (int8 experts expert-wise, int8 dense MLP and lm_head
    per channel, bf16 attention) loaded by the class into NxD's int8 layers; ids and logits as the
    test's own int8 reference (``_int8_reference``)."""
    assert {"QuantizedExpertFusedColumnParallel", "QuantizedExpertFusedRowParallel", "QuantizedColumnParallel",
            "QuantizedRowParallel"} <= set(lane["int8"]["classes"])


@pytest.mark.parametrize("case", ["int8", "int8_tp2", "defaults_int8"])
def test_the_int8_reference_is_the_source_rounded_per_channel(lane, case):
    """What the int8 cases are held to is the source checkpoint quantized by NxD's rule, not just
    whatever the rank files hold: the reference's state dict (the rank files read by the test,
    :func:`_int8_reference_weights`) against the source's tensors (:func:`_source_state_dict`).
    Each int8 tensor's per-channel scale ``[..., out, 1]`` is NxD's, computed here from the source
    in fp32: ``max(absmax over the input dim / 127, fp32 eps)`` per output channel (aws-neuron/
    neuronx-distributed ``src/neuronx_distributed/quantization/observer.py``,
    ``PerChannelAbsMaxObserver`` with ``per_channel_symmetric``; relative difference below 1e-6,
    measured 0), and each dequantized weight is within half a step of the source's (round to
    nearest, ``--algorithm max``: ``|q * scale - w| <= scale / 2``, measured 0.5000031 steps, the
    fp32 reciprocal g4 multiplies by); every other tensor, the device embedding shards
    reassembled and the host table, is the source's in bf16 bit for bit. A scale of
    ``absmax / 128`` (the clamped absmax element then 0.99 steps off) or a TP rank given another
    rank's scale rows fails here, though the NxDI class and a reference reading the same rank
    files agree on it."""
    from safetensors.torch import load_file

    ref = lane["int8_reference"][case]
    source = _source_state_dict(ref["source"])
    weights, scales = ref["weights"], ref["scales"]
    assert weights.keys() <= source.keys(), sorted(weights.keys() - source.keys())[:4]
    assert {k.split(".")[-2] if k.endswith(".weight") else k.split(".")[-1] for k in scales} == {
        "gate_proj", "up_proj", "down_proj", "gate_up_proj", "lm_head"}
    int8 = {}  # name: (max relative scale difference, max |w - source| in steps)
    for name, w in weights.items():
        x = source[name].float()
        if name in scales:
            step = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).eps)
            assert scales[name].shape == step.shape, name
            int8[name] = ((scales[name] / step - 1).abs().max().item(), ((w - x).abs() / step).max().item())
        else:
            assert torch.equal(w, source[name].to(torch.bfloat16).float()), f"{case} {name}: not the source's in bf16"
    off = {n: f"scale {e:.3g} off absmax/127, {s:.3g} steps" for n, (e, s) in int8.items()
           if e >= 1e-6 or s > 0.5 + 1e-4}
    assert not off, f"{case}: {len(off)} of {len(int8)} int8 tensors not the source rounded per channel: {off}"
    manifest = json.loads((ref["out"] / "manifest.json").read_text())
    host = load_file(ref["out"] / manifest["host_embedding"]["file"])[manifest["host_embedding"]["tensor"]]
    assert torch.equal(host, source["model.embed_tokens.weight"].to(torch.bfloat16))


def test_every_weight_comes_from_the_checkpoint(lane):
    for case in ("chat", "window4", "chat_tp2", "chat_tp2/rank1", "int8", "int8_tp2", "int8_tp2/rank1", "synth_heads",
                 "synth_heads_tp2", "synth_heads_tp2/rank1"):
        assert lane[case]["missing"] == [] and lane[case]["unexpected"] == [], case
    assert {"ExpertMLPsV2", "ColumnParallelLinear", "RowParallelLinear", "Gemma4KVCacheManager",
            "Gemma4ScaledEmbedding", "Gemma4SoftcappedLMHead"} <= set(lane["chat"]["classes"])


@pytest.mark.parametrize("case,tp,rank", [("int8", 1, 0), ("int8_tp2", 2, 0), ("int8_tp2/rank1", 2, 1)])
def test_int8_rank_file_is_the_class_state_dict_and_loads_unchanged(lane, case, tp, rank):
    """Route 2: the module's ``state_dict()`` (KV cache aside) has exactly the names, dtypes and
    per-rank shapes g4's layout table gives from the config alone (``expected_rank_specs``; the
    class is built in fp32 on the CPU, so the table's non-int8 dtype is fp32 here, bf16 in the
    files), and after ``to_cpu`` every tensor equals rank ``rank``'s file (its own rank index
    included: rank r holds ``[r]``)."""
    from g4.convert.resolve import EMBEDDED_DIR
    from g4.exporters.neuron_int8 import expected_rank_specs

    config = json.loads((EMBEDDED_DIR / "config.json").read_text())
    table = {s.name: [str(s.dtype).replace("torch.", ""), list(s.shape)]
             for s in expected_rank_specs(config, tp, quantize_attention=False, dtype=torch.float32)}
    r = lane[case]
    assert r["specs"] == table
    assert r["loaded_equal"] == sorted(table) and r["rank_file_keys"] == len(table)


@pytest.mark.parametrize("name", list(SPEC_TPS))
def test_the_layout_table_is_the_int8_class_state_dict_at_every_tp(lane, name):
    """g4's layout table from the config alone (``expected_rank_specs``, bf16 for what is not int8)
    against the class's own ``state_dict()`` at ``torch_dtype=bfloat16``, built on the meta device:
    the same names, dtypes and per-rank shapes (embedded at TP 1, 2, 4; the real 26B-A4B config at
    TP 2, 4, 8, where the full layers' 2 KV heads are replicated at TP 4 and 8)."""
    from g4.convert.resolve import EMBEDDED_DIR
    from g4.convert.synth import GEMMA4_26B_A4B
    from g4.exporters.neuron_int8 import expected_rank_specs

    r = lane["specs"]
    assert "error" not in r, (r.get("error"), r.get("where"))
    config = {"embedded": json.loads((EMBEDDED_DIR / "config.json").read_text()), "26B-A4B": GEMMA4_26B_A4B}[name]
    for tp in SPEC_TPS[name]:
        table = {s.name: [str(s.dtype).replace("torch.", ""), list(s.shape)]
                 for s in expected_rank_specs(config, tp, quantize_attention=False, dtype=torch.bfloat16)}
        got = r["specs"][f"{name}/tp{tp}"]
        assert got.keys() == table.keys(), (name, tp, sorted(got.keys() ^ table.keys())[:4])
        assert got == table, (name, tp, [(k, got[k], table[k]) for k in got if got[k] != table[k]][:3])


def test_int8_in_bf16_runs_on_the_module_nxdi_traces_for_neuron(lane):
    """The int8 result in bf16 (the dtype ``g4serve --backend neuron`` compiles with) on the module
    NxDI builds for tracing (``DecoderModelInstance.load_module``, which ``to_cpu`` now uses): it
    keeps every parameter named ``*scale`` in fp32, the router's ``scale`` and ``per_expert_scale``
    included, beside bf16 activations and a bf16 router projection (before the router cast its
    ``scale`` to the activation dtype this raised ``expected m1 and m2 to have the same dtype``).
    Against the fp32 int8 reference (``_int8_reference``): the same greedy ids; every step but one
    within ``TOL_BF16`` (measured 0.04-0.16), and that one, step 6 (after the reply's end of turn),
    within 1.5: measured 1.04, as transformers' own bf16 run differs from its fp32 run at that step
    (``test_bf16_weights_give_the_fp32_reference_ids_within_bf16_rounding``)."""
    r = lane["int8_bf16"]
    assert r["specs"]["layers.0.moe.router.scale"][0] == "float32"
    assert r["specs"]["layers.0.moe.router.proj.weight"][0] == "bfloat16"
    assert r["specs"]["layers.0.moe.expert_mlps.mlp_op.down_proj.weight"][0] == "int8"
    assert r["loaded_equal"] == sorted(r["specs"])
    assert r["tokens"] == r["ref_tokens"], (r["tokens"], r["ref_tokens"])
    per_step = (r["logits"] - r["ref_logits"]).abs().amax(dim=1)
    assert (per_step >= TOL_BF16).sum() <= 1 and per_step.max() < 1.5, per_step.tolist()


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ between two state dicts (dtype, shape or any bit)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:4]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def test_neuron_load_of_a_tp1_result_equals_nxdis_own_sharded_load(lane):
    """Route 2 (``load_weights`` -> ``g4_rank_weights``: the rank file cast by NxD's ``cast_weights``)
    against NxDI's Route 1 on the same TP-1 result (``get_builder().shard_checkpoint()``: NxDI's
    ``checkpoint_loader_fn`` and ``_cast_helper``, NxD's ``preprocess_checkpoint`` and
    ``get_sharded_checkpoint``), with the settings ``g4serve --backend neuron`` compiles with (bf16,
    buckets from the manifest): the same names, dtypes and bits, as ``nxd_model.initialize`` would get."""
    r = lane["route2"]
    route1, route2 = r["route1/tp1"], r["route2/tp1"]
    assert len(route1) == len(route2["weights"]) == 1 and route2["start_rank"] == [0]
    assert _same(route1[0], route2["weights"][0]) == []
    dtypes = {str(t.dtype) for t in route1[0].values()}
    assert {"torch.int8", "torch.float32", "torch.bfloat16", "torch.int32"} <= dtypes, dtypes


def test_neuron_load_at_tp2_and_4_gives_each_rank_its_own_file_with_nxds_dtypes(lane):
    """At TP 2 and 4, where NxDI's Route 1 cannot take a pre-sharded result: ``nxd_model.initialize``
    gets one dict per rank (each checked inside against the traced module's per-rank shapes), rank r's from ``weights/tp{r}_sharded_checkpoint.safetensors`` (bit-equal after the
    cast), with per name the dtype NxDI's own load gives at TP 1; asking for one rank
    (``start_rank_id=r, local_ranks_size=1``, a multi-host load) gives the same dict."""
    from safetensors.torch import load_file

    from g4.exporters.neuron_int8 import rank_file

    r = lane["route2"]
    dtypes = {k: v.dtype for k, v in r["route1/tp1"][0].items()}
    for tp in (2, 4):
        got = r[f"route2/tp{tp}"]
        assert len(got["weights"]) == tp and got["start_rank"] == [0]
        out = Path(lane["route2_dirs"][str(tp)])
        for rank, weights in enumerate(got["weights"]):
            assert {k: v.dtype for k, v in weights.items()} == dtypes
            assert _same(weights, got["single"][rank]) == []
            file = load_file(out / rank_file(rank))
            assert _same(weights, {k: file[k].to(dtypes[k]) for k in file}) == []
        differ = _same(got["weights"][0], got["weights"][1])
        assert "layers.0.moe.expert_mlps.mlp_op.down_proj.weight" in differ and "norm.weight" not in differ


def test_neuron_load_refuses_a_rank_file_that_is_not_the_layout(lane):
    for tp in (1, 2, 4):
        error = lane["route2"][f"refused/tp{tp}"]
        assert error and error.startswith("CheckpointError") and "down_projection.scale" in error, error


def test_a_result_for_another_tp_degree_is_refused(lane):
    r = lane["int8_tp_mismatch"]
    assert "written for TP 2" in r["error"] and "tp_degree 1" in r["error"], r["error"]


def test_lane_fits_its_budget(lane):
    """Workers and references within 2 minutes on 2 cores (the one-time overlay build not counted)."""
    assert lane["wall_s"] < 120, lane["wall_s"]


# ------------------------------------------------------------------ g4serve's neuron engine over the class
def test_neuron_engine_gives_the_int8_reference_ids_through_start_and_step(lane):
    """``NeuronEngine`` (``g4/serve/neuron_backend.py``) on a ``g4convert int8-neuron --tp 1 --seq-len 32``
    result in NxDI's CPU mode: ``start`` + 11 ``step`` calls give the int8 reference's ids and
    logits (``_int8_reference``, ``TOL``), and the same as ``greedy_generate`` on the same model object."""
    r = lane["engine"]
    assert r["tokens"] == r["ref_tokens"], (r["tokens"], r["ref_tokens"])
    assert r["tokens"] == r["greedy_tokens"]
    assert (r["logits"] - r["ref_logits"]).abs().max().item() < TOL
    assert (r["logits"] - r["greedy_logits"]).abs().max().item() < TOL
    assert r["logits"].abs().max() > 5
    assert "QuantizedExpertFusedColumnParallel" in r["classes"]


def test_neuron_engine_steps_on_the_kv_cache_within_the_manifest_length(lane):
    """One context-encoding call (prompt padded to the manifest's ``max_length`` 32, the one bucket
    of NxDI's CPU mode), then one ``[1, 1]`` token-generation call per step: no recompute. The
    engine's context is the manifest's ``max_length``."""
    r = lane["engine"]
    assert r["input_shapes"] == [[1, SEQ_LEN]] + [[1, 1]] * (NEW_TOKENS - 1)
    assert r["max_context"] == SEQ_LEN
    assert r["state"] == (0, len(_chat_ids(QUESTION)) + NEW_TOKENS - 1)  # (KV cache slot, positions)


def test_neuron_serving_modules_import_under_transformers_457(lane):
    """How g4 sits beside the Neuron SDK's NxDI (installed with ``--no-deps``, transformers 4.57
    kept): every module of the neuron serving path imports, and the result's tokenizer (written by
    transformers 5) loads."""
    r = lane["engine"]
    assert r["transformers"].startswith("4.57")
    assert all(v == "ok" for v in r["imports"].values()), r["imports"]


def test_http_chat_through_the_neuron_engine(lane):
    """``create_app`` over the engine inside the NxDI process: a chat request answers the embedded
    fact with the engine's greedy ids; a request whose prompt plus ``max_tokens`` exceeds the
    manifest's length gets the server's usual 400."""
    r = lane["engine"]
    chat = r["chat"]
    assert chat["status"] == 200, chat
    choice = chat["body"]["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    n = len(choice["token_ids"])
    assert choice["token_ids"] == r["tokens"][:n]
    too_long = r["too_long"]
    assert too_long["status"] == 400 and too_long["body"]["error"]["code"] == "context_length_exceeded", too_long
    assert r["models"]["data"][0]["max_model_len"] == SEQ_LEN


def test_decode_runs_past_the_context_encoding_bucket_to_the_end_of_the_kv_cache(lane):
    """``long``: an int8-neuron result converted with ``--seq-len 160 --max-context-length 32`` (window 4)
    served by ``NeuronEngine``: the prompt is one context-encoding call padded to 32 (the longest prompt,
    not the KV cache length: NxDI's ``max_context_length``), then one ``[1, 1]`` token-generation call
    per token to position 159 (five times the bucket; the full layer's cache holds 160 positions, the
    sliding layers' ring 3), fed English text (teacher forcing: greedy, the tiny model repeats its
    end-of-turn token): every step's logits within ``TOL`` of the int8 reference fed the same ids,
    the same argmax at every step."""
    r = lane["long"]
    n = LONG_SEQ_LEN - len(_chat_ids(WINDOW_QUESTION))
    assert len(r["tokens"]) == n and r["state"] == (0, LONG_SEQ_LEN - 1)
    assert r["tokens"] == r["ref_tokens"], (r["tokens"], r["ref_tokens"])
    assert (r["logits"] - r["ref_logits"]).abs().max().item() < TOL
    assert r["input_shapes"] == [[1, LONG_PROMPT]] + [[1, 1]] * (n - 1)
    assert sorted({shape[2] for shape in r["kv_shapes"]}) == [3, LONG_SEQ_LEN]
    assert (r["max_context"], r["max_prompt"]) == (LONG_SEQ_LEN, LONG_PROMPT)
    assert len(set(r["tokens"])) > 10  # the argmax follows the varied text it is fed


def test_a_prompt_longer_than_the_context_encoding_bucket_is_refused(lane):
    """A prompt of ``max_context_length + 1`` tokens (though prompt plus reply would fit the KV cache):
    ``NeuronEngine.start`` refuses it, and the server answers its usual 400 ``context_length_exceeded``
    naming the limit and the conversion option, before any generation."""
    for case, limit in (("long", LONG_PROMPT), ("engine", SEQ_LEN)):
        r = lane[case]
        assert r["start_over"].startswith("G4Error: prompt is") and f"at most {limit}" in r["start_over"], r["start_over"]
        over = r["over_prompt"]
        assert over["status"] == 400 and over["body"]["error"]["code"] == "context_length_exceeded", over
        assert f"prompts of at most {limit} tokens" in over["body"]["error"]["message"]
        assert "--max-context-length" in over["body"]["error"]["message"]


# ------------------------------------------- several requests at once: NxDI's continuous batching
@pytest.mark.parametrize("size", BATCH_SIZES)
def test_batched_requests_each_get_the_int8_reference_ids(lane, size):
    """``NeuronEngine`` at ``max_batch_size`` 2 and 4 (``is_continuous_batching``; a window-4 int8
    result, so each KV cache line's sliding layers are a ring) with the six requests of
    :data:`BATCH_REQUESTS` in six threads at once: each gets the int8 reference's ids and logits
    (``_int8_reference`` on its own, ``TOL``) for its own prompt, and what the batch-1 engine gives
    it, though it shared token-generation calls with requests of other lengths that joined and
    left."""
    r = lane["batch"]
    for i, (question, n) in enumerate(BATCH_REQUESTS):
        tokens, logits = r[size]["tokens"][i], r[size]["logits"][i]
        ref_tokens, ref_logits = r["ref"][i]
        assert tokens == ref_tokens[:n], (size, question, tokens, ref_tokens[:n])
        assert (logits - ref_logits[:n]).abs().max().item() < TOL, (size, question)
        assert tokens == r[1]["tokens"][i] and (logits - r[1]["logits"][i]).abs().max().item() < TOL
        assert logits.abs().max() > 5
    assert len({tuple(t) for t in r[size]["tokens"]}) > 3  # the requests' answers differ: no row mix-up passes


@pytest.mark.parametrize("size", BATCH_SIZES)
def test_batched_requests_share_token_generation_calls_in_b_kv_cache_lines(lane, size):
    """Context encoding one request at a time (``[1, 32]``, its own KV cache line), token
    generation ``[B, 1]`` (NxDI pads idle lines) with up to B requests per call: fewer calls than
    the requests' steps one by one; B KV cache lines; every slot free at the end. NxDI's CPU
    mode builds one module per wrapper (``models/application_base.py``: ``to_cpu``)."""
    r = lane["batch"][size]
    assert r["shapes"]["cte"] == [[1, SEQ_LEN]] * len(BATCH_REQUESTS)
    assert r["shapes"]["tkg"] == [[size, 1]] * len(r["decode_batches"])
    assert max(r["decode_batches"]) == size and sum(r["decode_batches"]) == sum(n - 1 for _, n in BATCH_REQUESTS)
    assert len(r["decode_batches"]) < sum(n - 1 for _, n in BATCH_REQUESTS)
    assert r["kv_lines"] == size and r["modules"] == 2 and r["active_after"] == 0


def test_http_requests_at_once_are_answered_as_one_at_a_time(lane):
    """``create_app`` over the batch-2 engine: two chat requests sent together are generated
    together (two threads; the first token-generation call has both rows) and answered exactly as the
    same requests one after another, with the int8 reference's greedy ids for their prompts."""
    r = lane["batch"]["http"]
    assert r["threads"] == 2
    refs = {q: lane["batch"]["ref"][i][0] for i, (q, _) in enumerate(BATCH_REQUESTS)}
    for question, together, alone in zip(HTTP_QUESTIONS, r["together"], r["alone"]):
        ids = together["choices"][0]["token_ids"]
        assert ids == alone["choices"][0]["token_ids"], (together, alone)
        assert together["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert len(ids) >= 2 and ids == refs[question][:len(ids)], (question, ids, refs[question])
    assert r["decode_batches"][0] == 2, r["decode_batches"]
