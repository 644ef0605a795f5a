"""MiniMax-M2: every layer full attention and MoE; q/k RMSNorms over the whole projection
("per_layer"), partial RoPE stated as `rotary_dim`, sigmoid routing with a correction bias.

The published config.json carries keys of the MiniMax family's earlier models (M1's lightning
attention and DeepNorm scales, a shared MLP, MTP modules). Those that describe the model
transformers runs are honoured; those that would change it are refused by name unless they hold
their neutral value. `intermediate_size` is the experts' width (there is no dense MLP).

The published config.json declares MTP modules (`use_mtp`, `num_mtp_modules` 3,
`mtp_transformer_layers` 1) that transformers does not build either: the target is complete
without them, so the keys are accepted and left out (`num_mtp_layers` 0; a checkpoint that does
hold their tensors is refused by `load_params` as holding tensors the config does not use).
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError, show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout

# MiniMaxM2Config's defaults that differ from the shared ones (read_shared).
DEFAULT_KV_HEADS = 8
DEFAULT_MAX_POSITIONS = 196608
DEFAULT_BOS, DEFAULT_EOS = 200034, 200020
# M1's DeepNorm residual scales: 1 means the plain pre-norm residual transformers runs.
_NEUTRAL_SCALES = (
  "layernorm_full_attention_alpha",
  "layernorm_full_attention_beta",
  "layernorm_linear_attention_alpha",
  "layernorm_linear_attention_beta",
  "layernorm_mlp_alpha",
  "layernorm_mlp_beta",
)


def _refuse_unless(r: HFConfigReader, key: str, ok: bool, what: str) -> None:
  """ConfigError naming `key` when its stated value asks for what jaxspec does not run."""
  if not ok:
    raise r.error(f"{key}={show(r.hf[key])}: {what} is not supported")


def _check_legacy(r: HFConfigReader, num_layers: int) -> None:
  """Refuses the MiniMax-family keys that would make the model differ from transformers'."""
  if r.has("attn_type_list"):
    types = r.integers("attn_type_list")
    _refuse_unless(
      r,
      "attn_type_list",
      len(types) == num_layers and all(t == 1 for t in types),
      f"anything but full attention (1) in each of the {num_layers} layers",
    )
  if r.has("sliding_window"):  # (null: no window)
    window = show(r.hf["sliding_window"])
    raise r.error(f"sliding_window={window}: sliding-window attention is not supported")
  if r.has("scoring_func"):
    sigmoid = r.string("scoring_func") == "sigmoid"
    _refuse_unless(r, "scoring_func", sigmoid, "a routing score other than the sigmoid")
  if r.has("use_routing_bias"):
    _refuse_unless(r, "use_routing_bias", r.flag("use_routing_bias"), "routing without the bias")
  if r.has("use_qk_norm"):
    _refuse_unless(r, "use_qk_norm", r.flag("use_qk_norm"), "attention without q/k norms")
  if r.has("qk_norm_type"):
    per_layer = r.string("qk_norm_type") == "per_layer"
    _refuse_unless(r, "qk_norm_type", per_layer, "a q/k norm other than per_layer")
  for key in ("shared_intermediate_size", "n_shared_experts"):
    if r.has(key):
      _refuse_unless(r, key, r.integer(key) == 0, "a shared expert")
  if r.has("postnorm"):
    _refuse_unless(r, "postnorm", not r.flag("postnorm"), "post-norm residuals")
  for key in _NEUTRAL_SCALES:
    if r.has(key):
      _refuse_unless(r, key, r.number(key) == 1.0, "a residual scale other than 1")
  if r.has("routed_scaling_factor"):
    _refuse_unless(
      r, "routed_scaling_factor", r.number("routed_scaling_factor") == 1.0, "a routed scale ≠ 1"
    )


def _partial_rotary(r: HFConfigReader, kw: dict[str, Any]) -> float:
  """The rotated fraction of each head: `rotary_dim` / head_dim (MiniMax's key), which must
  agree with a `partial_rotary_factor` stated beside it."""
  stated = r.has("partial_rotary_factor") or "partial_rotary_factor" in r.mapping(
    "rope_parameters"
  )
  if not r.has("rotary_dim"):
    return kw["partial_rotary_factor"]
  rotary_dim, head_dim = r.integer("rotary_dim"), kw["head_dim"]
  if not 0 < rotary_dim <= head_dim:
    raise r.error(f"rotary_dim must be in (0, head_dim={head_dim}], got {rotary_dim}")
  factor = rotary_dim / head_dim
  if stated and abs(kw["partial_rotary_factor"] - factor) > 1e-9:
    raise r.error(
      f"rotary_dim {rotary_dim} (of head_dim {head_dim}) disagrees with partial_rotary_factor "
      f"{kw['partial_rotary_factor']}"
    )
  return factor


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  num_layers = kw["num_layers"]
  _check_legacy(r, num_layers)
  experts = r.first_integer(("num_local_experts", "num_experts"), 256)
  return dict(
    num_kv_heads=r.integer("num_key_value_heads", DEFAULT_KV_HEADS),
    max_position_embeddings=r.integer("max_position_embeddings", DEFAULT_MAX_POSITIONS),
    partial_rotary_factor=_partial_rotary(r, kw),
    qk_norm=True,
    qk_norm_type="per_layer",
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 8),
    moe_intermediate_size=kw["intermediate_size"],
    router="sigmoid",
    norm_topk_prob=True,
    layer_is_moe=(True,) * num_layers,
    eos_token_ids=r.integers("eos_token_id", (DEFAULT_EOS,), scalar_ok=True),
    bos_token_id=r.integer("bos_token_id", DEFAULT_BOS),
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  if c.intermediate_size != c.moe_intermediate_size:
    raise ConfigError(
      f"MiniMax-M2 states one MLP width (the experts'): intermediate_size {c.intermediate_size} "
      f"≠ moe_intermediate_size {c.moe_intermediate_size}"
    )
  return dict(
    num_local_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    rotary_dim=c.rotary_dim,
    scoring_func="sigmoid",
    use_routing_bias=True,
    use_qk_norm=True,
    qk_norm_type="per_layer",
  )


MINIMAX_M2 = Architecture(
  name="MiniMaxM2ForCausalLM",
  model_type="minimax_m2",
  read=_read,
  write=_write,
  family=Family(float_router=True),
  rope_theta=5000000.0,
  rotary_fraction=1.0,
  head_dim=128,
  # Mixtral-style expert names (w1 gate, w3 up, w2 down), as published and as transformers saves
  tensors=TensorLayout(
    moe_block="block_sparse_moe", router_bias="e_score_correction_bias", experts=("w1", "w3", "w2")
  ),
)
