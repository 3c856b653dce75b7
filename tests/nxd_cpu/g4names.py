"""Every g4 name the NxD CPU lane uses, imported here only (g4's modules are being moved; repoint
these lines and nothing else)."""

from g4.convert.resolve import EMBEDDED_DIR  # noqa: F401
from g4.convert.int8_neuron import convert_int8_neuron  # noqa: F401
from g4.exporters.neuron_int8 import (  # noqa: F401
    COLUMN,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    KV_HEADS,
    ROW,
    geometry,
    layer_entries,
    layer_prefix,
    model_entries,
)
