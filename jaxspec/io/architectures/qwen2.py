"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): biases on q/k/v but not on o_proj, no q/k norms.

Published configs state `use_sliding_window: false` (their `sliding_window` and
`max_window_layers` then mean nothing, as in transformers). With it true, the layers from
`max_window_layers` on (or those `layer_types` names "sliding_attention") slide over
`sliding_window` positions.
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError, show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader

LAYER_TYPES = ("full_attention", "sliding_attention")


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  n = kw["num_layers"]
  sliding = r.flag("use_sliding_window", False)
  window = r.integer("sliding_window", 4096) if sliding else 0
  if sliding and window < 1:
    raise r.error(f"sliding_window must be positive with use_sliding_window, got {window}")
  first = r.integer("max_window_layers", 28)
  types = r.strings("layer_types", None)
  if types is None:
    types = tuple(LAYER_TYPES[bool(window) and i >= first] for i in range(n))
  if len(types) != n or set(types) - set(LAYER_TYPES):
    raise r.error(
      f"layer_types must name one of {LAYER_TYPES} for each of the {n} layers, "
      f"got {show(list(types))}"
    )
  if "sliding_attention" in types and not window:
    raise r.error("layer_types names sliding_attention layers but use_sliding_window is false")
  return dict(
    attention_bias=True,  # q/k/v always biased, o_proj never (attention_bias is not read)
    attention_out_bias=False,
    qk_norm=False,
    layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  if len({w for w in c.layer_windows if w}) > 1:
    raise ConfigError(f"{c.architecture} has one sliding window size, got {set(c.layer_windows)}")
  sliding = [i for i, w in enumerate(c.layer_windows) if w]
  return dict(
    use_sliding_window=bool(sliding),
    sliding_window=c.sliding_window or None,
    max_window_layers=sliding[0] if sliding else c.num_layers,
    layer_types=[LAYER_TYPES[bool(w)] for w in c.layer_windows],
  )


QWEN2 = Architecture(
  name="Qwen2ForCausalLM",
  model_type="qwen2",
  read=_read,
  write=_write,
  family=Family(windowed=True),
  sliding=True,
  rotary_fraction=None,
)
