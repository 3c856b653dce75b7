"""The neuron backend of ``g4serve``: an int8-neuron result on NeuronCores through g4's Gemma 4 MoE
class for neuronx-distributed-inference (NxDI) 0.8 (``g4.serve.nxdi_gemma4.NeuronGemma4MoEForCausalLM``),
behind the same engine interface as the CPU engines.

:class:`NeuronEngine` drives NxDI's own forward (``NeuronBaseForCausalLM.forward``,
aws-neuron/neuronx-distributed-inference ``src/neuronx_distributed_inference/models/model_base.py``):
``start`` is one context-encoding call on the prompt (NxDI pads it to the smallest context-encoding
bucket that holds it), ``step`` one token-generation call for the new token on NxDI's KV cache, no
recompute. With ``max_batch_size`` B > 1 (``g4serve --backend neuron --max-batch-size B``) the
model is built for NxDI's continuous batching (B KV cache lines) and up to B requests run at once:
each prompt is encoded into its own line, and one token-generation call advances all running
requests (:class:`~g4.serve.engine.StepBatcher`). The logits ``[V]`` go to the host sampler (``g4.serve.engine.sample_next``):
NxDI's on-device sampling stays off (the class does not wire it). The embedding runs on the device
(the class reads ``embed_tokens.safetensors`` and scales it by ``sqrt(hidden_size)``).

The serving shape comes from the result's ``manifest.json``
(:meth:`g4.exporters.neuron_int8.Manifest.serving_shape`): ``max_length`` tokens of prompt plus
reply (the KV cache length; the engine's ``max_context``, so the server refuses longer requests
with its usual ``context_length_exceeded``), the context-encoding bucket ladder up to the longest
prompt (NxDI's ``max_context_length``; the engine's ``max_prompt``, a longer prompt is refused the
same way) and the token-generation ladder up to ``max_length``.

On Neuron, :func:`load_neuron_engine` compiles once into ``OUT/neuron_compiled`` (or
``compiled_dir``) with NxDI's ``compile`` and loads it with ``load`` on later starts.
:func:`compile_neuron` (``g4serve compile OUT``) does the compile alone, on any x86 machine with
the Neuron SDK and enough host RAM for it, so the serving box only loads. The folder
carries ``g4_compiled.json``: a sha256 over the result's ``manifest.json`` and ``config.json`` and
the NxDI settings g4 compiled with; a folder whose stamp differs (another result, another
conversion, other settings) is compiled again, never silently used; a folder without the stamp is
not g4's and is refused. Weights are not copied into it: each load reads every rank's file from OUT (the class's
``load_weights``).
**Not yet run on inf2 hardware.**

On a CPU the same engine runs through NxDI's CPU mode (``NeuronConfig(on_cpu=True)`` and
``to_cpu()``, no compile; one context-encoding shape of ``max_context_length`` and one KV cache
of ``max_length``, the only shapes that mode supports); that
is for the tests (``tests/lanes/test_nxdi_gemma4.py``), not a backend users choose.

This module imports neither NxD nor NxDI at the top (``neuron_status`` must work without them);
:func:`load_neuron_engine` imports them.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import torch

from g4.core.checkpoint import CONFIG_NAME
from g4.core.errors import CheckpointError, G4Error
from g4.exporters.neuron_int8 import COMPILED_DIR, COMPILED_STAMP, MANIFEST, Manifest
from g4.serve.engine import Engine, StepBatcher, load_tokenizer

# NxDI's compiled model file inside the compiled folder
# (models/application_base.py: COMPILED_MODEL_FILE_NAME)
COMPILED_MODEL = "model.pt"


def neuron_status(*, need_device: bool = True) -> tuple[bool, str]:
    """Whether the neuron backend can run here: ``(available, reason in words)``. With
    ``need_device=False`` (``g4serve compile``): only the Neuron SDK's Python packages; a compile
    runs on any x86 machine that has them (aws-neuron/aws-neuron-sdk
    ``devflows/inference/ec2-then-ec2-devflow-inf2.rst``: "Model compilation can be executed on
    a non-inf2 instance")."""
    missing = [m for m in ("neuronx_distributed", "neuronx_distributed_inference", "torch_neuronx")
               if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed (Neuron SDK 2.28 for inf2)"
    if not need_device:
        return True, "neuronx-distributed(-inference) and torch-neuronx installed"
    if not glob.glob("/dev/neuron*"):
        return False, "neuronx-distributed is installed but no NeuronCore device (/dev/neuron*) is present"
    return True, "neuronx-distributed(-inference), torch-neuronx and NeuronCore devices present"


class NeuronEngine(Engine):
    """Generation on NxDI's KV cache through a loaded ``NeuronGemma4MoEForCausalLM``.

    Args:
        path: the int8-neuron result.
        model: the class after ``load`` (Neuron) or ``to_cpu`` (CPU), built with
            ``max_batch_size`` KV cache lines (:func:`nxdi_settings`).
        tokenizer: the result's tokenizer.
        max_length: tokens of prompt plus reply the model was built for (its KV cache).
        max_prompt: the longest prompt in tokens (its largest context-encoding bucket, NxDI's
            ``max_context_length``; default ``max_length``).
        description: one line for ``/v1/models`` and the start-up message.
        max_batch_size: sequences generated at once (B). 1: one request at a time. More: NxDI's
            continuous batching through :class:`~g4.serve.engine.StepBatcher`: each request's
            prompt is one context-encoding call into its own KV cache line (``seq_ids = [slot]``),
            and every running request's next token comes from one ``[B', 1]`` token-generation
            call (B' <= B rows; NxDI pads the idle lines).

    State of a sequence: ``(slot, positions in its KV cache line)``.
    """

    backend = "neuron"

    def __init__(self, path: Path, model, tokenizer, *, max_length: int, description: str,
                 max_batch_size: int = 1, max_prompt: int | None = None):
        super().__init__(path, tokenizer, description)
        self.model, self.max_length = model, max_length
        self.max_context = min(self.max_context, max_length)
        self.max_prompt = min(self.max_context, max_prompt or max_length)
        self.max_batch_size = max_batch_size
        self.batcher = StepBatcher(max_batch_size, self._encode, self._decode)

    @torch.no_grad()
    def _encode(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Context encoding of ``ids`` at positions ``0..`` into KV cache line ``slot``: fp32
        logits ``[V]`` of the last position."""
        input_ids = torch.tensor([ids], dtype=torch.long)
        positions = torch.arange(len(ids), dtype=torch.long)[None]
        # a mask of the real (unpadded) tokens; NxDI pads to the context-encoding bucket
        out = self.model(input_ids=input_ids, position_ids=positions, seq_ids=torch.tensor([slot], dtype=torch.int32),
                         attention_mask=torch.ones_like(input_ids))
        return out.logits[0, -1].float()

    @torch.no_grad()
    def _decode(self, rows) -> torch.Tensor:
        """One token-generation call: ``rows`` ``[(slot, position, token)]`` sorted by slot; fp32
        logits ``[len(rows), V]``. No mask: NxDI infers it from the positions
        (models/model_base.py: _infer_attention_mask)."""
        input_ids = torch.tensor([[t] for _, _, t in rows], dtype=torch.long)
        positions = torch.tensor([[p] for _, p, _ in rows], dtype=torch.long)
        seq_ids = torch.tensor([s for s, _, _ in rows], dtype=torch.int32)
        out = self.model(input_ids=input_ids, position_ids=positions, seq_ids=seq_ids, attention_mask=None)
        return out.logits[:, -1].float()

    def start(self, prompt_ids):
        if not prompt_ids:
            raise G4Error("empty prompt")
        if len(prompt_ids) > self.max_prompt:
            raise G4Error(f"prompt is {len(prompt_ids)} tokens; the neuron model encodes prompts of at most "
                          f"{self.max_prompt} (its largest context-encoding bucket)")
        return self.batcher.start(list(prompt_ids))

    def step(self, state, token):
        if state[1] + 1 > self.max_length:
            raise G4Error(f"prompt plus reply is {state[1] + 1} tokens; the neuron model holds {self.max_length}")
        return self.batcher.step(state, token)

    def finish(self, state) -> None:
        self.batcher.finish(state)


def compile_stamp(path: Path, settings: dict) -> dict:
    """What a compiled folder was built from: sha256 over the result's ``manifest.json`` and
    ``config.json`` bytes and the NxDI ``settings`` (JSON, sorted keys), with the settings
    themselves. Equal stamps mean the compiled graph fits this result.

    Raises:
        CheckpointError: ``manifest.json`` or ``config.json`` unreadable.
    """
    h = hashlib.sha256()
    try:
        for name in (MANIFEST, CONFIG_NAME):
            h.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\0")
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable int8-neuron result ({e})") from e
    h.update(json.dumps(settings, sort_keys=True).encode())
    return {"sha256": h.hexdigest(), "settings": settings}


def compiled_state(compiled: Path, stamp: dict) -> str:
    """``"current"`` (the folder holds a compile of exactly this stamp), ``"stale"`` (g4's compile
    of something else, or an interrupted one), or ``"absent"``.

    Raises:
        G4Error: ``compiled`` exists and is not g4's compiled folder (no stamp): it is not
            deleted.
    """
    if not compiled.exists():
        return "absent"
    try:
        found = json.loads((compiled / COMPILED_STAMP).read_text())
    except (OSError, ValueError):
        if compiled.is_dir() and not any(compiled.iterdir()):
            return "stale"
        raise G4Error(f"{compiled}: exists and is not a g4 compiled folder (no readable {COMPILED_STAMP}); "
                      "move it away or pass another --compiled-dir")
    return "current" if found == stamp and (compiled / COMPILED_MODEL).is_file() else "stale"


def nxdi_settings(manifest: Manifest, config: dict, *, on_cpu: bool, dtype: str, max_batch_size: int = 1) -> dict:
    """The ``MoENeuronConfig`` arguments g4 builds ``NeuronGemma4MoEForCausalLM`` with for an
    int8-neuron result (JSON-able; they go into the compile stamp): ``seq_len`` = ``max_length``
    (the KV cache), ``max_context_length`` the largest context-encoding bucket (the longest
    prompt). On Neuron NxDI's bucketing with the manifest's two ladders; on a CPU no bucketing
    (NxDI's CPU mode builds one module for ``seq_len`` and pads every prompt to
    ``max_context_length``).

    ``max_batch_size`` B > 1: NxDI's continuous batching (``models/config.py``: ``batch_size`` =
    ``max_batch_size`` = ``tkg_batch_size`` = ``kv_cache_batch_size`` B, ``ctx_batch_size`` 1,
    ``is_continuous_batching``): B KV cache lines, context encoding one request at a time,
    token generation for B rows.

    Raises:
        G4Error: ``max_batch_size`` below 1.
    """
    if max_batch_size < 1:
        raise G4Error(f"--max-batch-size must be at least 1, not {max_batch_size}")
    text = config.get("text_config") or config
    length, cte, tkg = manifest.serving_shape(text.get("max_position_embeddings"))
    settings = {"tp_degree": manifest.tp_degree, "batch_size": max_batch_size, "seq_len": length, "max_length": length,
                "torch_dtype": dtype, "quantized": True,
                "quantization_type": "expert_wise_per_channel_symmetric",
                "modules_to_not_convert": ["self_attn", "router", "embed_tokens"]}
    if max_batch_size > 1:
        settings.update(is_continuous_batching=True, ctx_batch_size=1, tkg_batch_size=max_batch_size,
                        max_batch_size=max_batch_size)
    if on_cpu:
        settings.update(on_cpu=True, max_context_length=cte[-1])
    else:
        settings.update(enable_bucketing=True, max_context_length=cte[-1], context_encoding_buckets=cte,
                        token_generation_buckets=tkg)
    return settings


def build_nxdi_model(path: Path, settings: dict):
    """``NeuronGemma4MoEForCausalLM`` of the result ``path`` configured by ``settings``
    (:func:`nxdi_settings`), not yet compiled or loaded. Imports NxD and NxDI."""
    # here, not at the top: nxdi_gemma4 imports NxD and NxDI, which only a Neuron host has
    from neuronx_distributed_inference.models.config import MoENeuronConfig

    from g4.serve.nxdi_gemma4 import Gemma4MoEInferenceConfig, NeuronGemma4MoEForCausalLM, load_gemma4_config

    kwargs = dict(settings, torch_dtype=getattr(torch, settings["torch_dtype"]), quantized_checkpoints_path=str(path))
    config = Gemma4MoEInferenceConfig(MoENeuronConfig(**kwargs), load_config=load_gemma4_config(str(path)))
    return NeuronGemma4MoEForCausalLM(str(path), config)


def _result_settings(path: Path, *, on_cpu: bool, max_batch_size: int = 1) -> dict:
    """:func:`nxdi_settings` of the int8-neuron result ``path`` from its manifest and config.

    Raises:
        CheckpointError: no manifest (not an int8-neuron result) or an unreadable ``config.json``.
    """
    manifest = Manifest.from_dir(path)
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/config.json: unreadable ({e})") from e
    return nxdi_settings(manifest, config, on_cpu=on_cpu, dtype="float32" if on_cpu else "bfloat16",
                         max_batch_size=max_batch_size)


def _ensure_compiled(path: Path, model, settings: dict, compiled: Path, log) -> str:
    """Compile ``model`` into ``compiled`` unless it holds this result's compile already
    (:func:`compiled_state`); returns the state found (``current``, ``stale``, ``absent``)."""
    stamp = compile_stamp(path, settings)
    state = compiled_state(compiled, stamp)
    if state != "current":
        log(f"compiling for Neuron into {compiled} ({'replacing a stale compile' if state == 'stale' else 'none there yet'};"
            " buckets " + ", ".join(f"{k} {settings[k]}" for k in ("context_encoding_buckets", "token_generation_buckets"))
            + ")")
        _what_the_class_cannot_load(path, lambda: _compile(model, compiled, stamp, replace=state == "stale"))
    return state


def compile_neuron(path: str | Path, *, compiled_dir: str | Path | None = None, max_batch_size: int = 1,
                   log=print) -> Path:
    """``g4serve compile``: compile the int8-neuron result ``path`` for NeuronCores with NxDI's
    ``compile`` (``models/application_base.py``: ``get_builder().trace(initialize_model_weights=False)``,
    no weights loaded) into ``compiled_dir`` (default ``PATH/neuron_compiled``), with exactly the
    settings ``g4serve --backend neuron`` loads with (:func:`nxdi_settings`), so the folder copied to
    the serving box's ``PATH/neuron_compiled`` (or passed there as ``--compiled-dir``) is reused by
    its stamp check (:func:`compiled_state`) instead of compiling again. NeuronCores are not needed
    (:func:`neuron_status` with ``need_device=False``); the Neuron SDK 2.28 packages are. A folder
    that holds this compile already is left as it is. Returns the folder. ``max_batch_size``: as
    :func:`load_neuron_engine`'s (the stamp holds it: a compile for another batch size is stale).

    Raises:
        G4Error: no Neuron SDK here (one line), a ``compiled_dir`` that is not g4's, a result the
            class cannot load yet; ``CheckpointError`` for a result that is not int8-neuron.
    """
    path = Path(path)
    settings = _result_settings(path, on_cpu=False, max_batch_size=max_batch_size)  # the result's own errors first
    if Manifest.from_dir(path).quantize_attention:
        # the class refuses it only when the weights are loaded (nxdi_gemma4._check_g4_int8_neuron),
        # which NxDI's compile skips: refused here, before hours of compile for a box that cannot use it
        raise G4Error(f"{path}: the neuron backend cannot load this result yet: it has int8 attention "
                      "(--quantize-attention), which g4's NxDI class does not take so far; convert without it")
    ok, why = neuron_status(need_device=False)
    if not ok:
        raise G4Error(f"cannot compile for Neuron here: {why}")
    compiled = Path(compiled_dir) if compiled_dir else path / COMPILED_DIR
    if compiled_state(compiled, compile_stamp(path, settings)) == "current":
        log(f"{compiled} already holds this result's compile (g4_compiled.json matches): nothing to do")
        return compiled
    _ensure_compiled(path, build_nxdi_model(path, settings), settings, compiled, log)
    log(f"compiled into {compiled}; copy that folder to the serving box as OUT/{COMPILED_DIR} (or pass "
        "--compiled-dir): g4serve --backend neuron then loads it without compiling")
    return compiled


def load_neuron_engine(path: str | Path, *, compiled_dir: str | Path | None = None, on_cpu: bool = False,
                       max_batch_size: int = 1, log=print) -> NeuronEngine:
    """The :class:`NeuronEngine` of the int8-neuron result ``path``.

    On Neuron: compile with NxDI into ``compiled_dir`` (default ``PATH/neuron_compiled``) unless
    it already holds this result's compile (:func:`compiled_state`), then ``load``. The compile is
    written into a temporary folder beside it and renamed into place when complete. With
    ``on_cpu`` (tests): NxDI's CPU mode, ``to_cpu()``, fp32, nothing written.

    Args:
        max_batch_size: requests run at once (:class:`NeuronEngine`); > 1 compiles for NxDI's
            continuous batching (B KV cache lines: the memory plan's ``--batch B``).
        log: called with one line per phase (compile, load).

    Raises:
        G4Error: no Neuron stack or device here (one line, from :func:`neuron_status`), a
            ``compiled_dir`` that is not g4's, an unreadable result (``CheckpointError``).
    """
    path = Path(path)
    if not on_cpu:
        ok, why = neuron_status()
        if not ok:
            raise G4Error(f"neuron backend unavailable: {why}")
    settings = _result_settings(path, on_cpu=on_cpu, max_batch_size=max_batch_size)
    tokenizer = load_tokenizer(path)
    model = build_nxdi_model(path, settings)
    where = (f"TP={settings['tp_degree']}, max_length {settings['max_length']}, prompts up to "
             f"{settings['max_context_length']}, batch {max_batch_size}")
    shape = dict(max_length=settings["max_length"], max_prompt=settings["max_context_length"],
                 max_batch_size=max_batch_size)
    if on_cpu:
        _what_the_class_cannot_load(path, model.to_cpu)
        return NeuronEngine(path, model, tokenizer, **shape,
                            description=f"int8-neuron through NxDI's CPU mode, {where}, float32")
    compiled = Path(compiled_dir) if compiled_dir else path / COMPILED_DIR
    _ensure_compiled(path, model, settings, compiled, log)  # on the serving box: better done apart (compile_neuron)
    log(f"loading the compiled model from {compiled}")
    _what_the_class_cannot_load(path, lambda: model.load(str(compiled)))
    return NeuronEngine(path, model, tokenizer, **shape,
                        description=f"int8-neuron on NeuronCores through NxDI 0.8, {where}, bfloat16")


def _what_the_class_cannot_load(path: Path, run) -> None:
    """``run()``; a result g4's NxDI class does not load yet (its ``NotImplementedError``, e.g.
    ``--quantize-attention``) becomes one ``error:`` line naming ``path``."""
    try:
        run()
    except NotImplementedError as e:
        raise G4Error(f"{path}: the neuron backend cannot load this result yet: {e}") from e


def _compile(model, compiled: Path, stamp: dict, *, replace: bool) -> None:
    """NxDI ``compile`` into ``compiled.partial`` beside ``compiled``, the stamp written last,
    then renamed into place (a stale folder, checked by :func:`compiled_state`, removed first)."""
    partial = compiled.with_name(f".{compiled.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        model.compile(str(partial))
        (partial / COMPILED_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if replace:
            shutil.rmtree(compiled)
        partial.rename(compiled)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
