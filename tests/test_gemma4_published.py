"""Gemma 4 configs as Google publishes them: `use_bidirectional_attention: "vision"`.

Every published Gemma 4 checkpoint states it in `text_config`; it makes image tokens attend to
each other both ways, and with no vision tower built, text decoding is causal (transformers
masks text-only input causally too). Other values stay refused, by name.
"""

from __future__ import annotations

import pytest
import transformers

from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"


def _text_config(**changes) -> dict:
  config = transformers.Gemma4TextConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    sliding_window=4,
    hidden_size_per_layer_input=0,
    layer_types=[SLIDING, FULL],
  ).to_dict()
  return {**config, **changes}


def _published(**changes) -> dict:
  """The layout of a published Gemma4ForConditionalGeneration config.json."""
  return {
    "architectures": ["Gemma4ForConditionalGeneration"],
    "text_config": _text_config(**changes),
  }


def test_the_vision_flag_reads_as_causal_text_decoding():
  plain = config_from_hf(_published())
  assert config_from_hf(_published(use_bidirectional_attention="vision")) == plain
  text_only = {
    **_text_config(use_bidirectional_attention="vision"),
    "architectures": ["Gemma4ForCausalLM"],
  }
  assert config_from_hf(text_only) == plain


@pytest.mark.parametrize("value", ["all", "text", True])
def test_other_bidirectional_values_are_refused_by_name(value):
  with pytest.raises(ConfigError, match="use_bidirectional_attention=.* is not supported"):
    config_from_hf(_published(use_bidirectional_attention=value))
