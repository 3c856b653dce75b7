"""The positions of each layer's KV cache in g4's NxDI class (``g4.core.gemma4.kv_cache_positions``),
the one rule the class's ``layer_to_cache_size_mapping`` and the memory plan read."""

import pytest

from g4.core.errors import G4Error
from g4.core.gemma4 import attention_layers, kv_cache_positions
from g4.convert.synth import GEMMA4_26B_A4B


def test_full_layers_hold_the_sequence_and_sliding_ones_the_window_less_the_new_token():
    layers = attention_layers(GEMMA4_26B_A4B["text_config"])
    got = kv_cache_positions(layers, 131072, 1024)
    assert [n for a, n in zip(layers, got) if a.sliding] == [1023] * 25
    assert [n for a, n in zip(layers, got) if not a.sliding] == [131072] * 5


def test_a_sequence_shorter_than_the_window_is_held_whole():
    layers = attention_layers(GEMMA4_26B_A4B["text_config"])
    assert set(kv_cache_positions(layers, 512, 1024)) == {512}
    assert set(kv_cache_positions(layers, 1023, 1024)) == {1023}
    assert sorted(set(kv_cache_positions(layers, 1024, 1024))) == [1023, 1024]


@pytest.mark.parametrize("window", [None, 0, 1])
def test_a_sliding_layer_without_a_usable_window_is_refused(window):
    layers = attention_layers(GEMMA4_26B_A4B["text_config"])
    with pytest.raises(G4Error, match="sliding_window"):
        kv_cache_positions(layers, 4096, window)


def test_no_positions_is_refused():
    with pytest.raises(G4Error, match="max_length 0"):
        kv_cache_positions(attention_layers(GEMMA4_26B_A4B["text_config"]), 0, 1024)
