"""Neuron-side loading of an int8-neuron result: the per-rank weight list that
neuronx-distributed's ``nxd_model.initialize`` takes, checked against the layout table.

Sources: aws-neuron/neuronx-distributed
``trace/spmd.py`` ``NxDModel.initialize(checkpoint: List[Dict[str, Tensor]], start_rank)``;
NxDI ``models/application_base.py`` ``load_weights``): one dict per local rank, keys the
traced module's ``state_dict()`` names, per-rank shapes, exact dtypes (int8 weights, fp32
scales, bf16 otherwise), contiguous tensors.

What is here runs on any machine: :func:`expected_rank_specs` derives every rank file's
names, dtypes and shapes from the config alone through the shared table, and
:func:`load_rank_weights` refuses files that differ. The module tree is
``g4.serve.neuron_model.NeuronTextModel``; :class:`NxdParallelOps` builds it from
neuronx-distributed's parallel layers, :func:`trace_neuron` traces it with ModelBuilder
into a weight-less ``model.pt`` and :func:`initialize_traced` binds the rank files to it.
Those three import neuronx-distributed / torch-neuronx lazily and have **not yet run on
inf2 hardware**; the same module tree with :class:`g4.serve.neuron_model.CpuParallelOps`
is what the tests run (one process per rank, gloo collectives).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from g4.convert.errors import CheckpointError, G4Error
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


class NxdParallelOps:
    """The parallel layers of ``g4.serve.neuron_model.NeuronTextModel`` from neuronx-distributed
    (Neuron SDK 2.28: NxD 0.17), for TP degree ``tp`` (NxD's parallel state must already be
    initialised, as ModelBuilder does when it builds the model).

    Layer choices (aws-neuron/neuronx-distributed ``quantization/quantization_layers.py``): int8 column /
    row linears are ``QuantizedColumnParallel`` / ``QuantizedRowParallel`` with
    ``PER_CHANNEL_SYMMETRIC`` and the channel axis passed explicitly (0; the enum-vs-string
    gotcha: a string leaves the axis None); bf16 attention uses ``ColumnParallelLinear`` / ``RowParallelLinear``;
    experts use ``QuantizedExpertFusedColumnParallel`` (stride 2, the ``[gate_r | up_r]``
    interleave) and ``QuantizedExpertFusedRowParallel`` (``reduce_output=False``) with
    ``EXPERT_WISE_PER_CHANNEL_SYMMETRIC`` int8 scales ``[E, 1, out]`` (axis 2), safe under
    selective expert loading.

    Not yet run on inf2 hardware.

    Raises:
        G4Error: neuronx-distributed is not installed (one line).
    """

    def __init__(self, tp: int, dtype: torch.dtype = torch.bfloat16):
        try:
            from neuronx_distributed.parallel_layers import layers, mappings
            from neuronx_distributed.quantization import quantization_config as qc
            from neuronx_distributed.quantization import quantization_layers as ql
        except ImportError as e:
            raise G4Error("neuronx-distributed is not installed here (Neuron SDK 2.28 for inf2); "
                          "the CPU module tree is g4.serve.neuron_model.CpuParallelOps") from e
        self.tp, self.dtype = tp, dtype
        self._layers, self._mappings, self._qc, self._ql = layers, mappings, qc, ql

    def _int8(self, axis: int, expert: bool) -> dict:
        qt = self._qc.QuantizationType
        return {"quantization_type": qt.EXPERT_WISE_PER_CHANNEL_SYMMETRIC if expert else qt.PER_CHANNEL_SYMMETRIC,
                "quantized_dtype": self._qc.QuantizedDtype.INT8, "quantization_per_channel_axis": axis,
                "dtype": self.dtype}

    def column(self, in_features: int, out_features: int, *, int8: bool, gather_output: bool = False):
        if int8:
            return self._ql.QuantizedColumnParallel(input_size=in_features, output_size=out_features, bias=False,
                                                    gather_output=gather_output, **self._int8(0, False))
        return self._layers.ColumnParallelLinear(in_features, out_features, bias=False, gather_output=gather_output,
                                                 dtype=self.dtype)

    def row(self, in_features: int, out_features: int, *, int8: bool):
        if int8:
            return self._ql.QuantizedRowParallel(input_size=in_features, output_size=out_features, bias=False,
                                                 input_is_parallel=True, reduce_output=True, **self._int8(0, False))
        return self._layers.RowParallelLinear(in_features, out_features, bias=False, input_is_parallel=True,
                                              dtype=self.dtype)

    def expert_gate_up(self, experts: int, hidden: int, intermediate: int):
        return self._ql.QuantizedExpertFusedColumnParallel(num_experts=experts, input_size=hidden,
                                                           output_size=2 * intermediate, stride=2,
                                                           **self._int8(2, True))

    def expert_down(self, experts: int, intermediate: int, hidden: int):
        return self._ql.QuantizedExpertFusedRowParallel(num_experts=experts, input_size=intermediate,
                                                        output_size=hidden, reduce_output=False,
                                                        **self._int8(2, True))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._mappings.reduce_from_tensor_model_parallel_region(x)


def trace_neuron(out_dir: str | Path, compiled_dir: str | Path, *, seq_len: int, batch: int = 1,
                 compiler_args: str = "--model-type=transformer -O1") -> Path:
    """Trace ``NeuronTextModel`` for this result with neuronx-distributed's ModelBuilder (V1,
    aws-neuron/neuronx-distributed ``trace/model_builder.py``) for inputs
    ``inputs_embeds [batch, seq_len, H]`` bf16 and ``position_ids [batch, seq_len]`` int64,
    without weights (``initialize_model_weights=False``), and save ``compiled_dir/model.pt``.
    Weights are bound later by :func:`initialize_traced` from the rank files.

    Not yet run on inf2 hardware.

    Raises:
        G4Error: neuronx-distributed is not installed, or the result is unreadable.
    """
    out_dir, compiled_dir = Path(out_dir), Path(compiled_dir)
    try:
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    except ImportError as e:
        raise G4Error("neuronx-distributed is not installed here (Neuron SDK 2.28 for inf2)") from e
    from g4.serve.neuron_model import NeuronTextModel

    try:
        manifest = Manifest.from_dir(out_dir)
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{out_dir}: not an int8-neuron result ({e})") from e
    tp, hidden = manifest.tp_degree, geometry(config, manifest.tp_degree).hidden
    quantize_attention = manifest.quantize_attention

    def build():
        return NeuronTextModel(config, NxdParallelOps(tp), quantize_attention=quantize_attention).eval()

    example = (torch.zeros(batch, seq_len, hidden, dtype=torch.bfloat16),
               torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous())
    builder = ModelBuilder(router=None, tp_degree=tp, checkpoint_loader=lambda: {},
                           compiler_workdir=str(compiled_dir / "workdir"))
    builder.add(key="forward", model_instance=BaseModelInstance(build, input_output_aliases={}),
                example_inputs=[example], compiler_args=compiler_args)
    traced = builder.trace(initialize_model_weights=False)
    compiled_dir.mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, str(compiled_dir / "model.pt"))
    return compiled_dir / "model.pt"
