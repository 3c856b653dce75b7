"""The rank files of an int8-neuron result checked exactly against the layout table:
:func:`expected_rank_specs` derives every rank file's names, dtypes and per-rank shapes from
``config.json`` alone through the shared table (``g4.exporters.neuron_int8``), independently of
the exporter, and :func:`load_rank_weights` reads the files and refuses any that differ (naming
the rank, the tensor and what differs). The result is the per-rank weight list in the form NxD's
pre-sharded loading takes (aws-neuron/neuronx-distributed ``trace/spmd.py``
``NxDModel.initialize(checkpoint: List[Dict[str, Tensor]], start_rank)``: one dict per rank,
exact dtypes, contiguous tensors).

The serving path does not go through it: ``g4.serve.neuron_backend`` hands the result to g4's
NxDI class (``g4.serve.nxdi_gemma4``), which reads the files itself and lets NxDI shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from g4.convert.errors import CheckpointError
from g4.exporters.neuron_int8 import Manifest, expected_rank_specs, geometry


def load_rank_weights(out_dir: str | Path, ranks: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """The per-rank state dicts of an int8-neuron result (all ranks in order, or the given
    ``ranks``), each checked exactly (names, dtypes, shapes) against :func:`expected_rank_specs`.

    Raises:
        CheckpointError: missing manifest/files, or a rank file that differs from the table
            (naming the rank, the tensor and what differs).
    """
    out_dir = Path(out_dir)
    try:
        manifest = Manifest.from_dir(out_dir)
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{out_dir}: not an int8-neuron result ({e})") from e
    expected = {s.name: s for s in expected_rank_specs(
        config, manifest.tp_degree, quantize_attention=manifest.quantize_attention)}
    weights = []
    files = manifest.rank_files
    for rank in range(len(files)) if ranks is None else ranks:
        if not 0 <= rank < len(files):
            raise CheckpointError(f"{out_dir}: no TP rank {rank} (TP degree {len(files)})")
        path = out_dir / files[rank]
        if not path.is_file():
            raise CheckpointError(f"{path}: rank {rank} weight file is missing")
        from g4.convert.checkpoint import read_safetensors_header

        read_safetensors_header(path)  # truncated or corrupt file: one clear error
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
