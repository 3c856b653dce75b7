"""The rank files of an int8-neuron result checked exactly against the layout table:
:func:`~g4.exporters.neuron_int8.expected_rank_specs` derives every rank file's names, dtypes and per-rank shapes from
``config.json`` alone through the shared table (``g4.exporters.neuron_int8``), independently of
the exporter; :func:`load_rank_weights` refuses files whose headers differ
(:func:`~g4.exporters.neuron_int8.check_rank_files`), then reads them (naming
the rank, the tensor and what differs). The result is the per-rank weight list in the form NxD's
pre-sharded loading takes (aws-neuron/neuronx-distributed ``trace/spmd.py``
``NxDModel.initialize(checkpoint: List[Dict[str, Tensor]], start_rank)``: one dict per rank,
exact dtypes, contiguous tensors).

g4's NxDI class (``g4.serve.nxdi_gemma4``) reads each rank's file through it, on the CPU
(``to_cpu``) and on Neuron (``load_weights``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from g4.exporters.neuron_int8 import check_rank_files


def load_rank_weights(out_dir: str | Path, ranks: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """The per-rank state dicts of an int8-neuron result (all ranks in order, or the given
    ``ranks``), each checked exactly (names, dtypes, shapes) against the layout table
    from its header before it is read (:func:`g4.exporters.neuron_int8.check_rank_files`).

    Raises:
        CheckpointError: missing manifest/files, or a rank file that differs from the table
            (naming the rank, the tensor and what differs).
    """
    _, _, paths = check_rank_files(out_dir, ranks, host=False)
    weights = []
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            weights.append({name: f.get_tensor(name).contiguous() for name in sorted(f.keys())})
    return weights
