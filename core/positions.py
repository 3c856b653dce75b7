"""The per-layer-type inputs of a Gemma 4 decoder layer, as ``Gemma4TextModel.forward`` builds
them: position ids, the rotary (cos, sin) of each layer type (``Gemma4TextRotaryEmbedding``:
sliding layers ``head_dim`` with ``rope_theta`` 10k, full layers ``global_head_dim`` with
proportional RoPE) and its attention mask (``masking_utils.create_causal_mask`` for full,
``create_sliding_window_causal_mask`` for sliding attention; None where sdpa's ``is_causal``
does it). Calibration, the layer-streamed runs and the int8-neuron emulator all run decoder
layers one at a time and take these from here (transformers/src/transformers/models/gemma4/modeling_gemma4.py).

transformers is imported when a builder is made, not with this module: it costs seconds, and
the command lines import the core without running a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerPositions:
    """The inputs of every decoder layer at one run of positions."""

    ids: torch.Tensor  # int64 [1, S]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, sin), each [1, S, head dim]
    masks: dict[str, torch.Tensor | None]  # layer type -> additive/bool mask, None: sdpa's is_causal


class PositionBuilder:
    """:class:`LayerPositions` for a Gemma 4 text config (a transformers ``Gemma4TextConfig``)."""

    def __init__(self, config):
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        self.config = config
        self.rotary = Gemma4TextRotaryEmbedding(config)

    def positions(self, hidden: torch.Tensor, past: int = 0, cache=None) -> LayerPositions:
        """The layer inputs for ``hidden`` ``[B, S, hidden_size]`` at positions ``past .. past+S-1``;
        ``cache``: the transformers cache being extended (decode), or None.

        Computed on the host (the rotary module lives there) and returned on ``hidden``'s device.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        on = hidden.device
        probe = hidden if on.type == "cpu" else torch.zeros(hidden.shape, dtype=hidden.dtype)
        position_ids = (torch.arange(hidden.shape[1]) + past).unsqueeze(0)
        kw = {"config": self.config, "inputs_embeds": probe, "attention_mask": None, "cache": cache,
              "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**kw), "sliding_attention": create_sliding_window_causal_mask(**kw)}
        rope = {t: self.rotary(probe, position_ids, t) for t in set(self.config.layer_types)}
        if on.type != "cpu":
            masks = {t: m if m is None else m.to(on) for t, m in masks.items()}
            rope = {t: tuple(x.to(on) for x in cs) for t, cs in rope.items()}
            position_ids = position_ids.to(on)
        return LayerPositions(position_ids, rope, masks)
