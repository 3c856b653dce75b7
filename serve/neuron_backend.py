"""The neuron backend of ``g4serve``: an int8-neuron result on NeuronCores through
neuronx-distributed, behind the same engine interface as the CPU engines.

The traced graph (``g4.serve.neuron_runtime.trace_neuron``) is
``g4.serve.neuron_model.NeuronTextModel`` at one static sequence length (the bucket): the
host embeds the ids (unscaled table times the manifest's ``embed_scale``), pads on the
right to the bucket (causal attention: padding never reaches earlier positions), and reads
the logits at the last real position. Every step recomputes the sequence (no on-device KV
cache yet), so prompt plus reply must fit in the bucket.

Availability needs neuronx-distributed and torch-neuronx importable and a NeuronCore
device (``/dev/neuron*``). Not yet run on inf2 hardware.
"""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from g4.convert.errors import CheckpointError, G4Error
from g4.serve.engine import Engine
from g4.exporters.neuron_int8 import EMBED_TENSOR, MANIFEST, Manifest, geometry
from g4.serve.neuron_model import host_embed


def neuron_status() -> tuple[bool, str]:
    """Whether the neuron backend can run here: ``(available, reason in words)``."""
    missing = [m for m in ("neuronx_distributed", "torch_neuronx") if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed (Neuron SDK 2.28 for inf2)"
    if not glob.glob("/dev/neuron*"):
        return False, "neuronx-distributed is installed but no NeuronCore device (/dev/neuron*) is present"
    return True, "neuronx-distributed, torch-neuronx and NeuronCore devices present"


class NeuronEngine(Engine):
    """Greedy/sampled generation with a traced Neuron model of fixed bucket length.

    Args:
        path: the int8-neuron result.
        forward: ``(inputs_embeds bf16 [1, S, H], position_ids int64 [1, S]) -> logits [1, S, V]``
            for ``S == seq_len``: the initialised traced model (or, in tests, the same module
            tree on the CPU).
        tokenizer: the result's tokenizer.
        seq_len: the bucket the model was traced for (tokens).
        dtype: activation dtype the graph takes (bf16 on Neuron).

    Raises:
        CheckpointError: unreadable manifest or host embedding table.
    """

    backend = "neuron"

    def __init__(self, path: Path, forward: Callable, tokenizer, *, seq_len: int,
                 dtype: torch.dtype = torch.bfloat16, description: str = "int8-neuron on NeuronCores"):
        super().__init__(path, tokenizer, description)
        try:
            manifest = Manifest.from_dir(path)
            self.table = load_file(Path(path) / manifest.host_embedding["file"])[EMBED_TENSOR]
        except (OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable int8-neuron result ({e})") from e
        config = json.loads((Path(path) / "config.json").read_text())
        scale = manifest.check_embed_scale(geometry(config, manifest.tp_degree).arch, Path(path) / MANIFEST)
        self.embed_scale, self.forward, self.seq_len, self.dtype = scale, forward, seq_len, dtype
        self.max_context = min(self.max_context, seq_len)

    def _logits(self, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        if n > self.seq_len:
            raise G4Error(f"prompt plus reply is {n} tokens; the traced bucket holds {self.seq_len}")
        padded = torch.tensor([ids + [0] * (self.seq_len - n)])
        pos = torch.arange(self.seq_len).unsqueeze(0)
        logits = self.forward(host_embed(self.table, padded, self.embed_scale, self.dtype), pos)
        return logits[0, n - 1].float()

    def start(self, prompt_ids):
        return list(prompt_ids), self._logits(list(prompt_ids))

    def step(self, state, token):
        ids = state + [token]
        return ids, self._logits(ids)


def load_neuron_engine(path: str | Path, *, compiled_dir: str | Path | None = None, seq_len: int = 1024) -> NeuronEngine:
    """Trace (once, into ``compiled_dir``, default ``PATH/neuron_compiled``) and initialise the
    Neuron model of the int8-neuron result ``path`` and wrap it in a :class:`NeuronEngine`.

    Raises:
        G4Error: no Neuron stack or device here (one line, from :func:`neuron_status`), or
            a result whose rank files do not fit the layout table.
    """
    from g4.serve.engine import load_tokenizer
    from g4.serve.neuron_runtime import initialize_traced, trace_neuron

    ok, why = neuron_status()
    if not ok:
        raise G4Error(f"neuron backend unavailable: {why}")
    path = Path(path)
    compiled = Path(compiled_dir) if compiled_dir else path / "neuron_compiled"
    model_pt = compiled / "model.pt"
    if not model_pt.is_file():
        trace_neuron(path, compiled, seq_len=seq_len)
    traced = initialize_traced(model_pt, path)
    return NeuronEngine(path, traced, load_tokenizer(path), seq_len=seq_len)
