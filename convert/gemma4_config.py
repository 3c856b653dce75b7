"""The two on-disk forms of a Gemma 4 config's attention geometry, read in one place.

Gemma 4 checkpoints ship in the **release form**: ``text_config.head_dim`` /
``num_key_value_heads`` for the sliding layers, ``global_head_dim`` (default 512) and
``num_global_key_value_heads`` (used only with ``attention_k_eq_v``) for the
full-attention layers. transformers >= 5.15 consumes those two keys in
``Gemma4TextConfig.__post_init__`` and saves the **per_layer_config form** instead:
``text_config.per_layer_config = {"05": {"head_dim": 512, "num_key_value_heads": 2}, ...}``,
keyed by the layer index zero-padded to the widest index, and no release keys
(huggingface/transformers ``src/transformers/models/gemma4/configuration_gemma4.py``,
``integrations/heterogeneity/configuration_utils.py``). vLLM, llama.cpp, MLX and older
transformers read only the release keys (case P17: vllm-project/vllm issues #51744, #52768).

:func:`attention_layers` is the one reader of head dims, KV heads and ``v_proj`` presence
per layer; :func:`release_config` writes a config back in the release form.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .errors import G4Error

RELEASE_GLOBAL_HEAD_DIM_DEFAULT = 512  # Gemma4TextConfig.__post_init__: global_head_dim = kwargs.pop(..., 512)
_OVERRIDE_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class AttentionLayer:
    """Attention shape of one decoder layer: ``kv_heads`` KV heads of ``head_dim``;
    ``has_v`` is False on full-attention layers with ``attention_k_eq_v`` (no v_proj)."""

    sliding: bool
    head_dim: int
    kv_heads: int
    has_v: bool


def text_config_of(config: dict) -> dict:
    """The text sub-config of a multimodal config (``text_config``), or ``config`` itself."""
    return config.get("text_config") or config


def layer_types(tc: dict) -> list[str]:
    """``layer_types`` as transformers 5.24 builds it: 5 sliding : 1 full when absent, and the
    last layer forced to ``full_attention``.

    Raises:
        G4Error: ``layer_types`` does not have one entry per layer.
    """
    n = tc.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise G4Error(f"text config: num_hidden_layers is {n!r}, expected a positive integer")
    types = list(tc.get("layer_types") or
                 ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)])
    if len(types) != n:
        raise G4Error(f"text config: {len(types)} layer_types for {n} layers")
    types[-1] = "full_attention"
    return types


def _per_layer_overrides(tc: dict, n_layers: int) -> dict[int, dict]:
    raw = tc.get("per_layer_config") or {}
    if not isinstance(raw, dict):
        raise G4Error(f"text config: per_layer_config is {type(raw).__name__}, expected an object keyed by layer index")
    out: dict[int, dict] = {}
    for key, over in raw.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            index = -1
        if not 0 <= index < n_layers or not isinstance(over, dict):
            raise G4Error(f"text config: per_layer_config entry {key!r} is not a layer index in [0, {n_layers}) "
                          "with an object of overrides")
        if index in out:
            raise G4Error(f"text config: per_layer_config names layer {index} twice")
        out[index] = over
    return out


def attention_layers(config: dict) -> tuple[AttentionLayer, ...]:
    """Per-layer head dim, KV heads and ``v_proj`` presence of a Gemma 4 config, in either form.

    ``config`` is a multimodal config (with ``text_config``) or a text config. Follows
    transformers 5.24: when ``per_layer_config`` is present (even empty) it is the whole
    truth and ``global_head_dim`` / ``num_global_key_value_heads`` are ignored; otherwise
    full-attention layers get ``global_head_dim`` (default 512) and, only with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` KV heads.

    Raises:
        G4Error: a missing or non-positive size, or a malformed ``per_layer_config``.
    """
    tc = text_config_of(config)

    def positive(where: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise G4Error(f"text config: {where} is {value!r}, expected a positive integer")
        return value

    types = layer_types(tc)
    head_dim = positive("head_dim", tc.get("head_dim"))
    kv = positive("num_key_value_heads", tc.get("num_key_value_heads"))
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    per_layer = "per_layer_config" in tc
    overrides = _per_layer_overrides(tc, len(types)) if per_layer else {}
    layers = []
    for i, t in enumerate(types):
        full = t == "full_attention"
        if per_layer:
            over = overrides.get(i, {})
            hd = positive(f"per_layer_config[{i}].head_dim", over.get("head_dim", head_dim))
            kvh = positive(f"per_layer_config[{i}].num_key_value_heads", over.get("num_key_value_heads", kv))
        elif full:
            hd = positive("global_head_dim", tc.get("global_head_dim") or RELEASE_GLOBAL_HEAD_DIM_DEFAULT)
            g_kv = tc.get("num_global_key_value_heads") if k_eq_v else None
            kvh = kv if g_kv is None else positive("num_global_key_value_heads", g_kv)
        else:
            hd, kvh = head_dim, kv
        layers.append(AttentionLayer(sliding=not full, head_dim=hd, kv_heads=kvh, has_v=not (full and k_eq_v)))
    return tuple(layers)


def release_config(config: dict) -> dict:
    """A copy of ``config`` in the release form: ``per_layer_config`` replaced by
    ``global_head_dim`` and ``num_global_key_value_heads`` (in its place; every other key
    and the key order kept). A config already in the release form is returned unchanged
    (as a copy). The result reads back, in g4 and in transformers 5.24, to the same
    :func:`attention_layers`.

    Raises:
        G4Error: a ``per_layer_config`` the release form cannot express (overrides other
            than ``head_dim`` / ``num_key_value_heads``, sliding layers that differ from the
            base sizes, full layers that differ from each other, or a full-layer KV-head
            override without ``attention_k_eq_v``).
    """
    config = copy.deepcopy(config)
    tc = text_config_of(config)
    if "per_layer_config" not in tc:
        return config
    layers = attention_layers(config)
    why = "g4 writes the release form (global_head_dim / num_global_key_value_heads) that vLLM reads"
    for key, over in (tc.get("per_layer_config") or {}).items():
        extra = sorted(set(over) - set(_OVERRIDE_KEYS))
        if extra:
            raise G4Error(f"text config: per_layer_config[{key!r}] overrides {', '.join(extra)}; {why}, which has "
                          "no such per-layer keys")
    base = (tc["head_dim"], tc["num_key_value_heads"])
    odd = [i for i, a in enumerate(layers) if a.sliding and (a.head_dim, a.kv_heads) != base]
    if odd:
        raise G4Error(f"text config: per_layer_config changes sliding layer {odd[0]}; {why}, where sliding layers "
                      f"all have head_dim {base[0]} and {base[1]} KV heads")
    full = {(a.head_dim, a.kv_heads) for a in layers if not a.sliding}
    if len(full) != 1:
        raise G4Error(f"text config: per_layer_config gives the full-attention layers different sizes {sorted(full)}; "
                      f"{why}, which has one size for all of them")
    (g_head_dim, g_kv), = full
    k_eq_v = bool(tc.get("attention_k_eq_v", False))
    if not k_eq_v and g_kv != base[1]:
        raise G4Error(f"text config: per_layer_config gives full-attention layers {g_kv} KV heads without "
                      f"attention_k_eq_v; {why}, where num_global_key_value_heads applies only with attention_k_eq_v")
    rewritten = {}
    for key, value in tc.items():
        if key == "per_layer_config":
            rewritten["global_head_dim"] = g_head_dim
            rewritten["num_global_key_value_heads"] = g_kv if k_eq_v else None
        elif key not in ("global_head_dim", "num_global_key_value_heads"):
            rewritten[key] = value
    tc.clear()
    tc.update(rewritten)
    return config
