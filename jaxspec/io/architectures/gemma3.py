"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type gemma3_text; the text part of
`Gemma3ForConditionalGeneration`, whose vision tower and projector are not built).

Sliding-window and full-attention layers (`layer_types`, or every `sliding_window_pattern`-th
layer full; window `sliding_window`: keys p seen by query q iff p > q − W); the sliding layers
turn whole heads by the default RoPE with their own base (`rope_local_base_freq`), the full
layers by `rope_theta` and the optional `rope_scaling` (linear, factor 8 on the 4B and larger
models); transformers 5 states both per layer type in `rope_parameters`, and either spelling is
read. The softmax scale is `query_pre_attn_scalar`^-0.5; q/k RMSNorms; every RMSNorm stores w and
scales by 1 + w; sandwich norms around attention and the MLP; token embeddings scaled by
sqrt(hidden_size); a GELU-tanh MLP (`hidden_activation`); the head tied to the embeddings.

Published multimodal configs state only what differs from transformers' Gemma3TextConfig
defaults in their `text_config` (gemma-3-4b-it: no vocab_size or head counts), so those
defaults fill what a config leaves out. Refused by name: attention-logit soft-capping,
bidirectional attention, RoPE types other than default and linear.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxspec.config import ModelConfig
from jaxspec.errors import show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import FULL, SLIDING, HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout, norm_entries

MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# transformers' Gemma3TextConfig defaults, for the keys published configs leave out.
DEFAULTS = dict(
  vocab_size=262_208,
  hidden_size=2304,
  intermediate_size=9216,
  num_hidden_layers=26,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=256,
  max_position_embeddings=131_072,
  rms_norm_eps=1e-6,
  pad_token_id=0,
  eos_token_id=1,
  bos_token_id=2,
  tie_word_embeddings=True,
  query_pre_attn_scalar=256,
  sliding_window=4096,
)
DEFAULT_THETA = {SLIDING: 10_000.0, FULL: 1_000_000.0}
DEFAULT_PATTERN = 6
# Where the legacy flat keys state each layer type's RoPE base.
LEGACY_THETA = {SLIDING: "rope_local_base_freq", FULL: "rope_theta"}
FAMILY = Family(
  windowed=True,
  sandwich_norms=True,
  centred_norms=True,
  embedding_scale=True,
  query_scalar=True,
  per_type_rope=True,
  logit_softcapping=True,
)


def _per_type_rope(r: HFConfigReader) -> dict[str, dict[str, Any]]:
  """Each layer type's RoPE settings, from `rope_parameters` nested per type and the legacy
  `rope_scaling` (the full layers') / `rope_theta` / `rope_local_base_freq`; a setting stated
  in both places must agree."""
  nested = r.rope_per_layer_type()
  rope = {kind: dict(nested.get(kind) or {}) for kind in (SLIDING, FULL)}
  legacy = {k: v for k, v in r.mapping("rope_scaling").items() if v is not None}
  for key, value in legacy.items():
    stated = rope[FULL].get(key)
    if key in ("rope_type", "type"):
      key, stated = "rope_type", rope[FULL].get("rope_type") or rope[FULL].get("type")
    if stated is not None and stated != value:
      raise r.error(f"rope_scaling.{key} and rope_parameters.full_attention disagree")
    rope[FULL][key] = value
  for kind, d in rope.items():
    if r.has(LEGACY_THETA[kind]):
      theta = r.number(LEGACY_THETA[kind])
      if d.get("rope_theta") is not None and float(d["rope_theta"]) != theta:
        raise r.error(f"{LEGACY_THETA[kind]} and rope_parameters.{kind}.rope_theta disagree")
      d["rope_theta"] = theta
    d.setdefault("rope_theta", DEFAULT_THETA[kind])
    d["rope_type"] = d.pop("type", None) or d.get("rope_type") or "default"
  sliding = rope[SLIDING]
  if sliding["rope_type"] != "default" or set(sliding) - {"rope_type", "rope_theta"}:
    raise r.error(
      f"the sliding layers' RoPE must be the default one, got {show(sliding)} "
      "(rope_parameters.sliding_attention)"
    )
  return rope


def _prepare(hf: Mapping[str, Any]) -> dict[str, Any]:
  """transformers' defaults filled in, the full layers' RoPE folded into the flat keys the
  shared reader reads (`rope_theta`, `rope_scaling`), the sliding layers' base and the
  activation kept under `_` keys for `_read`."""
  out = {**DEFAULTS, **hf}
  r = HFConfigReader(out, "Gemma3ForCausalLM")
  rope = _per_type_rope(r)
  full = {k: v for k, v in rope[FULL].items() if k != "rope_theta"}
  for key in ("rope_parameters", "rope_scaling", "rope_local_base_freq", "partial_rotary_factor"):
    out.pop(key, None)
  out["rope_theta"] = float(rope[FULL]["rope_theta"])
  if full["rope_type"] != "default" or len(full) > 1:
    out["rope_scaling"] = full
  out["_sliding_theta"] = float(rope[SLIDING]["rope_theta"])
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if hf.get("hidden_act") not in (None, act):
    raise r.error("hidden_act and hidden_activation disagree")
  out.pop("hidden_act", None)  # (the shared reader knows only silu)
  out["_hidden_act"] = act
  return out


def _layer_types(r: HFConfigReader, n: int) -> list[str]:
  """`layer_types`, or transformers' pattern: every `sliding_window_pattern`-th layer full."""
  pattern = r.integer("sliding_window_pattern", DEFAULT_PATTERN)
  if pattern < 1:
    raise r.error(f"sliding_window_pattern must be ≥ 1, got {pattern}")
  default = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
  types = list(r.strings("layer_types", default))
  if set(types) - {SLIDING, FULL} or len(types) != n:
    raise r.error(
      f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {n} layers, got "
      f"{show(types)}"
    )
  return types


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  types = _layer_types(r, kw["num_layers"])
  for key in ("use_bidirectional_attention", "attn_logit_softcapping"):
    if r.hf.get(key):
      raise r.error(f"{key}={show(r.hf[key])} is not supported (causal attention, uncapped)")
  act = r.hf["_hidden_act"]
  if act != "gelu_pytorch_tanh":
    raise r.error(f"hidden_activation {show(act)} is not supported ('gelu_pytorch_tanh')")
  window = r.integer("sliding_window")
  if SLIDING in types and window < 1:
    raise r.error(f"sliding_window must be ≥ 1, got {window}")
  scalar = r.number("query_pre_attn_scalar")
  if not scalar > 0:
    raise r.error(f"query_pre_attn_scalar must be positive, got {scalar}")
  cap = r.hf.get("final_logit_softcapping")
  return dict(
    qk_norm=True,
    hidden_act=act,
    tie_word_embeddings=r.flag("tie_word_embeddings", True),
    layer_windows=tuple(window if t == SLIDING else 0 for t in types),
    sliding_rope_theta=r.hf["_sliding_theta"],
    query_pre_attn_scalar=scalar,
    final_logit_softcapping=0.0 if cap is None else r.number("final_logit_softcapping"),
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  windows = {w for w in c.layer_windows if w}
  full = {"rope_type": "default", **dict(c.rope_scaling), "rope_theta": c.rope_theta}
  return dict(
    hidden_act=c.hidden_act,
    hidden_activation=c.hidden_act,
    sliding_window=windows.pop() if windows else DEFAULTS["sliding_window"],
    layer_types=[SLIDING if w else FULL for w in c.layer_windows],
    rope_parameters={
      SLIDING: {"rope_type": "default", "rope_theta": c.sliding_rope_theta or c.rope_theta},
      FULL: full,
    },
    partial_rotary_factor=None,
    # (an integer, as transformers' strict Gemma3TextConfig requires)
    query_pre_attn_scalar=int(q) if (q := c.query_pre_attn_scalar) == int(q) else q,
    final_logit_softcapping=c.final_logit_softcapping or None,
    attn_logit_softcapping=None,
  )


GEMMA3 = Architecture(
  name="Gemma3ForCausalLM",
  model_type="gemma3_text",
  read=_read,
  write=_write,
  family=FAMILY,
  sliding=True,
  rope_theta=DEFAULT_THETA[FULL],
  rotary_fraction=None,
  rope_types=("default", "linear"),
  head_dim=DEFAULTS["head_dim"],
  prepare=_prepare,
  # the sandwich norms around the MLP
  tensors=TensorLayout(
    layer_extras=norm_entries("pre_feedforward_layernorm", "post_feedforward_layernorm")
  ),
)
