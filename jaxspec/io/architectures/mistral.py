"""Mistral (MistralForCausalLM): Llama's decoder without biases, every layer optionally sliding.

`sliding_window` is one window for all layers (null: full attention; absent: transformers'
default of 4096); the layers then hold a ring of it (jaxspec.state.SlidingKV) once the context
is longer, as gpt-oss's sliding layers do.
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader

# MistralConfig's sliding_window when config.json does not state the key.
DEFAULT_WINDOW = 4096


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  stated_null = "sliding_window" in r.hf and r.hf["sliding_window"] is None
  window = 0 if stated_null else r.integer("sliding_window", DEFAULT_WINDOW)
  if not stated_null and window < 1:
    raise r.error(f"sliding_window must be positive or null, got {window}")
  return dict(
    attention_bias=False,  # transformers builds none, whatever attention_bias says
    attention_out_bias=False,
    qk_norm=False,
    layer_windows=(window,) * kw["num_layers"],
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  if len(set(c.layer_windows)) > 1:
    raise ConfigError(
      f"{c.architecture} has one sliding window for every layer, got {c.layer_windows}"
    )
  return dict(sliding_window=c.sliding_window or None)


MISTRAL = Architecture(
  name="MistralForCausalLM",
  model_type="mistral",
  read=_read,
  write=_write,
  family=Family(windowed=True),
  rotary_fraction=None,
)
