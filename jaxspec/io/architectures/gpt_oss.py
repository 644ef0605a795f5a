"""gpt-oss: sliding-window layers beside full ones, attention sinks, biased experts with the
clamped SwiGLU, top-k-then-softmax routing and YaRN RoPE when config.json states none."""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError, show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader

# gpt-oss's RoPE when config.json states none (transformers' GptOssConfig default).
DEFAULT_ROPE = {
  "rope_type": "yarn",
  "factor": 32.0,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "truncate": False,
  "original_max_position_embeddings": 4096,
}


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  num_layers = kw["num_layers"]
  stated_null = "sliding_window" in r.hf and r.hf["sliding_window"] is None  # no window
  window = None if stated_null else r.integer("sliding_window", 128)
  if window is not None and window < 1:
    raise r.error(f"sliding_window must be positive or null, got {window}")
  types = r.strings("layer_types", None)
  if types is None:
    types = tuple(
      "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    )
  bad = sorted(set(types) - {"sliding_attention", "full_attention"})
  if bad or len(types) != num_layers:
    raise r.error(
      f"layer_types must name 'sliding_attention' or 'full_attention' for each of the "
      f"{num_layers} layers, got {show(list(types))}"
    )
  experts = r.first_integer(("num_local_experts", "num_experts"), 0)
  if experts < 1:
    raise r.error(f"num_local_experts must be positive, got {experts}")
  return dict(
    attention_out_bias=kw["attention_bias"],
    qk_norm=False,
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 4),
    moe_intermediate_size=kw["intermediate_size"],
    router="topk_softmax",
    expert_bias=True,
    swiglu_limit=r.number("swiglu_limit", 7.0),
    swiglu_alpha=r.number("swiglu_alpha", 1.702),
    layer_is_moe=(True,) * num_layers,
    layer_windows=tuple((window or 0) if t == "sliding_attention" else 0 for t in types),
    attention_sinks=True,
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  if len(set(w for w in c.layer_windows if w)) > 1:
    raise ConfigError(f"gpt-oss has one sliding window size, got {set(c.layer_windows)}")
  return dict(
    intermediate_size=c.moe_intermediate_size,
    num_local_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    swiglu_limit=c.swiglu_limit,
    swiglu_alpha=c.swiglu_alpha,
    sliding_window=c.sliding_window or None,
    layer_types=["sliding_attention" if w else "full_attention" for w in c.layer_windows],
  )


GPT_OSS = Architecture(
  name="GptOssForCausalLM",
  model_type="gpt_oss",
  read=_read,
  write=_write,
  family=Family(windowed=True, fused_gate_up="interleaved", biased_experts=True, hf_mxfp4=True),
  sliding=True,
  rope_theta=150000.0,
  rotary_fraction=None,
  default_rope=DEFAULT_ROPE,
  attention_bias=True,
)
