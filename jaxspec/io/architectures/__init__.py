"""The Hugging Face `config.json` mapping of every target architecture jaxspec builds.

`config_from_hf` reads a config.json dict into a `ModelConfig`, rejecting what it does not
understand rather than guessing; `config_to_hf` writes one back. Each architecture family is one
small module here (its fields and defaults), registered in `ARCHITECTURES`; what every family
shares is read and written once, in `base.py`. A new architecture is a new module and a line
in the table; building the table registers each record's `Family` (jaxspec.family), which is
what `ModelConfig` validates against and model code branches on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxspec import family as family_lib
from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError, show
from jaxspec.io.architectures import (
  deepseek_v3,
  gemma3,
  gemma4,
  glm4_moe,
  gpt_oss,
  llama,
  mistral,
  mimo_v2_flash,
  minimax_m2,
  qwen2,
  qwen3,
  qwen3_next,
)
from jaxspec.io.architectures.base import Architecture, read_shared, write_shared
from jaxspec.io.architectures.reader import HFConfigReader

__all__ = [
  "ARCHITECTURES",
  "MULTIMODAL_TEXT_ARCHITECTURES",
  "Architecture",
  "HFConfigReader",
  "config_from_hf",
  "config_to_hf",
  "text_config",
]

ARCHITECTURES: dict[str, Architecture] = {
  a.name: a
  for a in (
    qwen3.QWEN3,
    qwen3.QWEN3_MOE,
    llama.LLAMA,
    mistral.MISTRAL,
    qwen2.QWEN2,
    glm4_moe.GLM4_MOE,
    gpt_oss.GPT_OSS,
    qwen3_next.QWEN3_NEXT,
    qwen3_next.QWEN3_5,
    qwen3_next.QWEN3_5_MOE,
    deepseek_v3.DEEPSEEK_V3,
    deepseek_v3.DEEPSEEK_V32,
    deepseek_v3.GLM_MOE_DSA,
    mimo_v2_flash.MIMO_V2_FLASH,
    minimax_m2.MINIMAX_M2,
    gemma3.GEMMA3,
    gemma4.GEMMA4,
  )
}
# A multimodal checkpoint's architecture -> the text model's, read from its `text_config`.
MULTIMODAL_TEXT_ARCHITECTURES = {
  **qwen3_next.MULTIMODAL_TEXT,
  **deepseek_v3.MULTIMODAL_TEXT,
  **gemma3.MULTIMODAL_TEXT,
  **gemma4.MULTIMODAL_TEXT,
}
for _arch in ARCHITECTURES.values():
  family_lib.register(_arch.name, _arch.family)


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
  """The text model's config.json dict: `hf` itself, or a multimodal checkpoint's `text_config`
  as its text architecture (top-level keys it lacks, such as tie_word_embeddings, inherited)."""
  archs = hf.get("architectures") if isinstance(hf, Mapping) else None
  if not (isinstance(archs, (list, tuple)) and len(archs) == 1):
    return hf
  text_arch = MULTIMODAL_TEXT_ARCHITECTURES.get(archs[0])
  if text_arch is None:
    return hf
  inner = hf.get("text_config")
  if not isinstance(inner, Mapping):
    raise ConfigError(f"{archs[0]} config.json has no text_config object")
  outer = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
  return {**outer, **inner, "architectures": [text_arch]}


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
  """Builds a ModelConfig from a HF `config.json` dict; raises ConfigError on what it can't run.

  Every field is type-checked as it is read (see `HFConfigReader`): vocab_size, hidden_size,
  num_hidden_layers, num_attention_heads and intermediate_size are required, the rest default
  as in transformers when absent or null. RoPE is the default type or one of the scalings in
  `ROPE_TYPES`, stated consistently wherever the config states it (`HFConfigReader.rope`,
  `rope_scaling`). `overrides` are ModelConfig fields applied last (`options=RunOptions(...)`
  for how to run it); the result is validated as a whole.
  """
  if not isinstance(hf, Mapping):
    raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
  hf = text_config(hf)
  archs = hf.get("architectures") or []
  if not isinstance(archs, (list, tuple)) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise ConfigError(
      f"unsupported architectures {show(archs)} in config.json; jaxspec supports exactly one "
      f"of {', '.join(ARCHITECTURES)}"
    )
  arch = ARCHITECTURES[archs[0]]
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise ConfigError(
      f"{arch.name}: unknown ModelConfig field(s) {', '.join(unknown)} in overrides"
    )
  if arch.prepare is not None:
    hf = arch.prepare(hf)
  r, kw = read_shared(HFConfigReader(hf, arch.name), arch)
  kw.update(arch.read(r, kw))
  kw.update(overrides)
  return ModelConfig(**kw)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The HF `config.json` dict that describes `config`'s architecture (inverse of
  `config_from_hf`)."""
  arch = ARCHITECTURES[config.architecture]
  hf = write_shared(config, arch)
  hf.update(arch.write(config))
  return hf

