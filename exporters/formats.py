"""Tell what a g4 result (or plain checkpoint) is from its own files.

Three formats are recognised, in this order:

* ``int8-neuron``: ``manifest.json`` whose ``format`` is ``g4-int8-neuron/2`` (written by
  ``g4convert int8-neuron``; layout and sources in ``exporters/neuron_int8.py``).
* ``nvfp4``: ``hf_quant_config.json`` with ``quantization.quant_algo == "NVFP4"``, or a
  ``config.json`` whose ``quantization_config`` has ``quant_method: modelopt`` and
  ``quant_algo: NVFP4`` (modelopt's export; see ``g4.exporters.modelopt_nvfp4``).
  W4A4 when a config group declares ``input_activations`` (then every quantized linear has an
  ``input_scale``), W4A16 otherwise.
* ``bf16``: a Hugging Face Gemma 4 checkpoint (``config.json`` with ``model_type`` ``gemma4``
  or ``gemma4_text``, no ``quantization_config``, safetensors weights): the source itself.

Anything else is refused with a one-line :class:`g4.core.errors.CheckpointError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from g4.core.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG, Checkpoint, read_json_object
from g4.core.errors import CheckpointError
from g4.core.gemma4 import MODEL_TYPES
from g4.exporters.modelopt_nvfp4 import check_export
from g4.exporters.neuron_int8 import LAYOUT_NAME, MANIFEST, check_rank_files

NVFP4, INT8_NEURON, BF16 = "nvfp4", "int8-neuron", "bf16"

# The files g4 writes into a result beside its weights and format metadata.
FACTS_FILE = "g4_conversion.json"  # the conversion's facts (g4.convert.card.check_facts)
CARD_FILE = "README.md"  # the model card (g4.convert.card.render_card)
VERIFICATION_FILE = "verification.json"  # g4serve check's report (g4.serve.check)
EVAL_FILE = "eval.json"  # g4convert eval's report (g4.convert.evaluate)


@dataclass(frozen=True)
class ResultFormat:
    """What ``path`` holds.

    Attributes:
        format: ``"nvfp4"``, ``"int8-neuron"`` or ``"bf16"``.
        path: the directory.
        w4a4: NVFP4 with calibrated ``input_scale`` tensors (activation quantization);
            False for W4A16 and for the other formats.
        detail: one line for logs, e.g. ``"NVFP4 W4A4 (modelopt)"``.
    """

    format: str
    path: Path
    w4a4: bool
    detail: str


def detect_format(path: str | Path) -> ResultFormat:
    """Detect the format of the directory ``path`` from its own files (no source needed).

    Raises:
        CheckpointError: ``path`` is not a directory, its metadata is unreadable, or it is none
            of the three formats (e.g. another quantization method, or no config.json).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    manifest = path / MANIFEST
    if manifest.is_file():
        layout = read_json_object(manifest).get("format")
        if layout == LAYOUT_NAME:
            return ResultFormat(INT8_NEURON, path, False, f"int8-neuron ({layout})")
        raise CheckpointError(f"{manifest}: unknown layout {layout!r} (expected {LAYOUT_NAME!r})")
    config_path = path / CONFIG_NAME
    config = read_json_object(config_path) if config_path.is_file() else None
    hf_quant = path / HF_QUANT_CONFIG
    algo = None
    if hf_quant.is_file():
        algo = (read_json_object(hf_quant).get("quantization") or {}).get("quant_algo")
    qc = (config or {}).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config is not an object")
    if algo == "NVFP4" or (qc and qc.get("quant_method") == "modelopt" and qc.get("quant_algo") == "NVFP4"):
        if config is None:
            raise CheckpointError(f"{path}: NVFP4 metadata but no config.json")
        w4a4 = any(isinstance(g, dict) and "input_activations" in g
                   for g in ((qc or {}).get("config_groups") or {}).values())
        return ResultFormat(NVFP4, path, w4a4, f"NVFP4 {'W4A4' if w4a4 else 'W4A16'} (modelopt)")
    if algo is not None:
        raise CheckpointError(f"{hf_quant}: quant_algo {algo!r} is not served by g4 (NVFP4 only)")
    if config is None:
        raise CheckpointError(f"{path}: no config.json, manifest.json or hf_quant_config.json: "
                              "not a g4 result or a Hugging Face checkpoint")
    if qc:
        method = qc.get("quant_method") or qc.get("quant_algo") or "unknown"
        raise CheckpointError(f"{config_path}: quantization method {method!r} is not served by g4 "
                              "(NVFP4, int8-neuron or unquantized bf16 only)")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{config_path}: model_type {model_type!r} is not Gemma 4 "
                              f"({' or '.join(MODEL_TYPES)})")
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no *.safetensors weights (pickled weights are never loaded)")
    return ResultFormat(BF16, path, False, f"unquantized Gemma 4 checkpoint ({config.get('dtype', 'bf16')})")


def check_result(path: str | Path) -> ResultFormat:
    """Detect the format of ``path`` (:func:`detect_format`) and check the finished result
    against its format's table before anything trusts it (``g4convert verify``, ``g4serve check``,
    ``g4serve OUT``, ``g4convert push``). Headers and JSON only: no tensor is read, so it costs
    milliseconds even for the 26B.

    * ``nvfp4``: :func:`g4.exporters.modelopt_nvfp4.check_export` with ``values=False``: every
      header name, dtype and shape against the output table rebuilt from OUT
      (:func:`~g4.exporters.modelopt_nvfp4.output_layout`), the roles of every quantized
      linear, and the exclusion list.
    * ``int8-neuron``: :func:`g4.exporters.neuron_int8.check_rank_files`: the manifest, every
      rank file against the layout table, the host embedding table.
    * ``bf16``: the index and shard headers hold together and the config is a Gemma 4 MoE
      (:class:`g4.core.checkpoint.Checkpoint`).

    Raises:
        G4Error: one line naming the file (and tensor) and what differs; see :func:`detect_format`.
    """
    fmt = detect_format(path)
    if fmt.format == NVFP4:
        check_export(fmt.path, values=False)
    elif fmt.format == INT8_NEURON:
        check_rank_files(fmt.path)
    else:
        Checkpoint(fmt.path)
    return fmt
