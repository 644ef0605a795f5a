"""Llama (LlamaForCausalLM): the plain pre-norm decoder, no q/k norms, whole-head RoPE.

Llama 3.1 and later state the "llama3" RoPE scaling (HFConfigReader.rope_scaling). Biases on
all four attention projections come with `attention_bias`; `mlp_bias` (biased MLP projections)
is not built and is refused by name.
"""

from __future__ import annotations

from typing import Any

from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  if r.flag("mlp_bias", False):
    raise r.error("mlp_bias=true (biased MLP projections) is not supported")
  return dict(attention_out_bias=kw["attention_bias"], qk_norm=False)


LLAMA = Architecture(
  name="LlamaForCausalLM",
  model_type="llama",
  read=_read,
  write=lambda c: {"mlp_bias": False},
  rotary_fraction=None,
)
