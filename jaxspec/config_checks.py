"""What a valid `ModelConfig` is: the values each field may take and how fields must agree.

`validate(config)` runs from `ModelConfig.__post_init__` and raises ConfigError naming the first
field jaxspec cannot run as given. A field that only some families use is refused elsewhere by
its family's feature (jaxspec.family), never by an architecture's name. This module reads the
config through its attributes and does not import jaxspec.config (which calls it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jaxspec.errors import ConfigError, is_int, is_real, show
from jaxspec.family import Family, architectures_with, family_of
from jaxspec.options import RunOptions

# Activations of the dense MLP: SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
QK_NORM_TYPES = ("per_head", "per_layer")
# A layer's token mixer: attention, or Gated DeltaNet in hybrid targets.
LAYER_TYPES = ("full_attention", "linear_attention")
# DSA layers run their own indexer ("full") or reuse the previous full one's choice.
INDEXER_TYPES = ("full", "shared")
# RoPE variants jaxspec computes (layers.rope_frequencies); families add theirs (Family.rope_types:
# Gemma 4's "proportional").
ROPE_TYPES = ("default", "linear", "yarn", "dynamic", "llama3")
ROUTERS = ("softmax", "sigmoid", "topk_softmax", "gemma4")

# ModelConfig fields → the config.json key users see, for messages about values read from it.
_HF_NAMES = {
  "num_layers": "num_hidden_layers",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "num_mtp_layers": "num_nextn_predict_layers",
}
# Integer fields that must be ≥ 1 and ≥ 0, float fields that must be > 0, boolean fields.
_POSITIVE_INTS = (
  "vocab_size",
  "hidden_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "max_position_embeddings",
  "n_group",
  "topk_group",
  "decoder_sparse_step",
  "linear_conv_kernel_dim",
)
_COUNTS = (
  "intermediate_size",
  "num_experts",
  "num_experts_per_tok",
  "moe_intermediate_size",
  "n_shared_experts",
  "num_mtp_layers",
  "linear_key_head_dim",
  "linear_value_head_dim",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "shared_expert_intermediate_size",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "index_n_heads",
  "index_head_dim",
  "index_topk",
  "sliding_num_kv_heads",
  "global_head_dim",
  "global_num_kv_heads",
  "num_kv_shared_layers",
  "hidden_size_per_layer_input",
  "vocab_size_per_layer_input",
)
_POSITIVE_FLOATS = (
  "swiglu_alpha",
  "rms_norm_eps",
  "rope_theta",
  "partial_rotary_factor",
  "routed_scaling_factor",
  "attention_value_scale",
)
_BOOLS = (
  "attention_bias",
  "attention_out_bias",
  "qk_norm",
  "tie_word_embeddings",
  "norm_topk_prob",
  "expert_bias",
  "attention_sinks",
  "rope_interleave",
  "indexer_rope_interleave",
  "sliding_attention_sinks",
  "attention_k_eq_v",
  "use_double_wide_mlp",
  "mtp_own_embed",
  "mtp_own_head",
)

Need = Callable[[bool, str], None]


def _needs(c: Any) -> Need:
  """need(cond, msg): ConfigError "<architecture>: msg" unless cond."""

  def need(cond: bool, msg: str) -> None:
    if not cond:
      raise ConfigError(f"{c.architecture}: {msg}")

  return need


def _name(field: str) -> str:
  """`field`, with its config.json name when that differs (messages reach HF users)."""
  hf = _HF_NAMES.get(field)
  return f"{field} ({hf})" if hf else field


def _of(feature: Callable[[Family], Any]) -> str:
  """The architectures with `feature`, for messages."""
  return ", ".join(architectures_with(feature))


def check_types(c: Any) -> None:
  """Every numeric field of ModelConfig `c` a real int / finite float / bool: no bools, NaNs or
  64.5 sizes."""
  need = _needs(c)
  need(
    isinstance(c.options, RunOptions),
    f"options must be a jaxspec.RunOptions, got {show(c.options)}",
  )
  for name in _POSITIVE_INTS + _COUNTS:
    v = getattr(c, name)
    need(is_int(v), f"{_name(name)} must be an integer, got {show(v)}")
  for name in _POSITIVE_FLOATS:
    v = getattr(c, name)
    need(is_real(v) and math.isfinite(v), f"{name} must be a finite number, got {show(v)}")
  for name in _BOOLS:
    v = getattr(c, name)
    need(isinstance(v, bool), f"{name} must be True or False, got {show(v)}")
  for name in ("pad_token_id", "bos_token_id"):
    v = getattr(c, name)
    need(v is None or is_int(v), f"{name} must be an integer or None, got {show(v)}")
  need(
    isinstance(c.eos_token_ids, tuple) and all(is_int(t) for t in c.eos_token_ids),
    f"eos_token_ids must be a tuple of integers, got {show(c.eos_token_ids)}",
  )
  need(
    isinstance(c.layer_is_moe, (tuple, list)),
    f"layer_is_moe must be a tuple of booleans, got {show(c.layer_is_moe)}",
  )
  need(
    is_real(c.swiglu_limit) and math.isfinite(c.swiglu_limit) and c.swiglu_limit >= 0,
    f"swiglu_limit must be a finite number ≥ 0, got {show(c.swiglu_limit)}",
  )
  need(
    isinstance(c.layer_types, (tuple, list)) and all(t in LAYER_TYPES for t in c.layer_types),
    f"layer_types must name {' or '.join(LAYER_TYPES)} per layer, got {show(c.layer_types)}",
  )
  need(
    isinstance(c.layer_windows, (tuple, list))
    and all(is_int(w) and w >= 0 for w in c.layer_windows),
    f"layer_windows must be a tuple of integers ≥ 0, got {show(c.layer_windows)}",
  )


def validate(c: Any) -> None:
  """Raises ConfigError naming the first field of ModelConfig `c` that jaxspec cannot run."""
  check_types(c)
  need = _needs(c)
  family = family_of(c.architecture)
  for name in _POSITIVE_INTS:
    v = getattr(c, name)
    need(v > 0, f"{_name(name)} must be positive, got {v}")
  for name in _COUNTS:
    v = getattr(c, name)
    need(v >= 0, f"{_name(name)} must be ≥ 0, got {v}")
  for name in _POSITIVE_FLOATS:
    v = getattr(c, name)
    need(v > 0, f"{name} must be positive, got {v}")
  need(
    c.partial_rotary_factor <= 1,
    f"partial_rotary_factor must be in (0, 1], got {c.partial_rotary_factor}",
  )
  need(
    all(t >= 0 for t in c.eos_token_ids),
    f"eos token ids must be ≥ 0, got {list(c.eos_token_ids)}",
  )
  dense_mlp = not all(c.layer_is_moe) or (c.num_mtp_layers and not c.mtp_is_moe)
  need(
    c.intermediate_size > 0 or not dense_mlp,
    f"intermediate_size must be positive for the dense MLP layers, got {c.intermediate_size}",
  )
  need(
    c.num_heads % c.num_kv_heads == 0,
    f"num_attention_heads ({c.num_heads}) must be a multiple of num_key_value_heads "
    f"({c.num_kv_heads})",
  )
  need(
    c.rotary_dim % 2 == 0 and 0 < c.rotary_dim <= c.head_dim,
    f"rotary dim {c.rotary_dim} (head_dim × partial_rotary_factor) must be even and in "
    f"(0, head_dim]",
  )
  _validate_layer_lists(c, family, need)
  _validate_linear(c, family, need)
  _validate_mla(c, family, need)
  _validate_attention(c, family, need)
  _validate_gemma4(c, family, need)
  scaling = dict(c.rope_scaling) if isinstance(c.rope_scaling, tuple) else {}
  rope_types = ROPE_TYPES[1:] + family.rope_types
  need(
    isinstance(c.rope_scaling, tuple)
    and (not c.rope_scaling or scaling.get("rope_type") in rope_types),
    f"rope_scaling must be () or normalized (name, value) pairs of a {ROPE_TYPES[1:]} "
    f"scaling, got {show(c.rope_scaling)}",
  )
  _validate_moe(c, family, need)


def _validate_layer_lists(c: Any, family: Family, need: Need) -> None:
  """One entry per layer in each per-layer tuple; MoE layers where the family's rule puts them."""
  need(
    len(c.layer_is_moe) == c.num_layers,
    f"layer_is_moe has {len(c.layer_is_moe)} entries but num_layers is {c.num_layers}: "
    f"it needs one entry per layer",
  )
  need(
    c.decoder_sparse_step >= 1,
    f"decoder_sparse_step must be positive, got {c.decoder_sparse_step}",
  )
  if c.decoder_sparse_step > 1:
    sparse = architectures_with(lambda f: f.moe_rule == "sparse_step")
    need(
      family.moe_rule == "sparse_step",
      f"decoder_sparse_step applies only to {' and '.join(sparse)}",
    )
    off_step = [
      i for i, moe in enumerate(c.layer_is_moe) if moe and (i + 1) % c.decoder_sparse_step
    ]
    need(
      not off_step,
      f"layers {off_step} are MoE but decoder_sparse_step={c.decoder_sparse_step} allows "
      f"experts only in layers i with (i + 1) % step == 0",
    )
  need(
    len(c.layer_windows) == c.num_layers,
    f"layer_windows has {len(c.layer_windows)} entries but num_layers is "
    f"{c.num_layers}: it needs one entry per layer",
  )
  need(
    len(c.layer_types) == c.num_layers,
    f"layer_types has {len(c.layer_types)} entries but num_layers is {c.num_layers}: "
    f"it needs one entry per layer",
  )


def _validate_linear(c: Any, family: Family, need: Need) -> None:
  """Gated DeltaNet layers and the gated shared expert: hybrid families only, consistent."""
  if any(t == "linear_attention" for t in c.layer_types):
    need(family.hybrid, f"linear_attention layers need one of {_of(lambda f: f.hybrid)}")
    for name in (
      "linear_key_head_dim",
      "linear_value_head_dim",
      "linear_num_key_heads",
      "linear_num_value_heads",
    ):
      need(getattr(c, name) > 0, f"{name} must be positive for linear_attention layers")
    need(
      c.linear_num_value_heads % c.linear_num_key_heads == 0,
      f"linear_num_value_heads ({c.linear_num_value_heads}) must be a multiple of "
      f"linear_num_key_heads ({c.linear_num_key_heads})",
    )
    need(
      c.linear_conv_kernel_dim >= 2,
      f"linear_conv_kernel_dim must be ≥ 2, got {c.linear_conv_kernel_dim}",
    )
  need(
    not c.shared_expert_intermediate_size or family.hybrid,
    "a gated shared expert (shared_expert_intermediate_size) is a feature of "
    f"{_of(lambda f: f.hybrid)}",
  )


def _validate_attention(c: Any, family: Family, need: Need) -> None:
  """Sliding windows, sinks, q/k norms and gpt-oss's experts: where the family has them."""
  sliding_only = (c.sliding_attention_sinks, c.sliding_num_kv_heads, c.sliding_rope_theta)
  need(
    family.windowed or not (c.attention_sinks or c.sliding_window or any(sliding_only)),
    f"attention sinks and sliding windows are features of {_of(lambda f: f.windowed)}",
  )
  need(
    is_real(c.sliding_rope_theta) and c.sliding_rope_theta >= 0,
    f"sliding_rope_theta must be ≥ 0 (0: rope_theta), got {show(c.sliding_rope_theta)}",
  )
  need(
    c.qk_norm_type in QK_NORM_TYPES,
    f"qk_norm_type must be one of {QK_NORM_TYPES}, got {show(c.qk_norm_type)}",
  )
  kv_sliding = c.sliding_num_kv_heads or c.num_kv_heads
  need(
    c.num_heads % kv_sliding == 0,
    f"num_attention_heads ({c.num_heads}) must be a multiple of the sliding layers' KV "
    f"heads ({kv_sliding})",
  )
  need(
    family.biased_experts
    or not (c.expert_bias or c.swiglu_limit or c.router == "topk_softmax"),
    "biased experts, the clamped SwiGLU and the top-k-softmax router are gpt-oss features "
    f"({_of(lambda f: f.biased_experts)})",
  )
  need(
    c.options.attention_impl != "pallas"
    or not (c.attention_sinks or c.sliding_attention_sinks or c.sliding_window),
    "the Pallas attention kernel has no sinks or sliding windows; use attention_impl='xla'",
  )


def _validate_moe(c: Any, family: Family, need: Need) -> None:
  """Routed experts: counts, router, groups."""
  if not c.is_moe:
    need(not any(c.layer_is_moe), "layer_is_moe set on a model without experts")
    return
  need(
    0 < c.num_experts_per_tok <= c.num_experts,
    f"num_experts_per_tok must be in [1, num_experts={c.num_experts}]",
  )
  need(c.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
  need(c.router in ROUTERS, f"unknown router {c.router!r}")
  need(
    (c.router == "gemma4") == family.moe_beside_mlp,
    "the gemma4 router (scaled RMS-normed input, per-expert scales) is the MoE block's that "
    f"runs beside the MLP ({_of(lambda f: f.moe_beside_mlp)}), and that block uses it",
  )
  need(c.num_experts % c.n_group == 0, "n_routed_experts must divide into n_group groups")
  need(1 <= c.topk_group <= c.n_group, "topk_group must be in [1, n_group]")
  if c.router == "sigmoid" and c.n_group > 1:
    need(
      c.num_experts // c.n_group >= 2,
      "grouped routing scores each group by its top-2 experts: need ≥ 2 experts per group",
    )


def _validate_gemma4(c: Any, family: Family, need: Need) -> None:
  """Gemma's mechanisms (global attention shapes, KV sharing, per-layer inputs, soft-capping,
  the MoE block beside the MLP, Gemma 3's query scalar): only in families that have them, and
  consistent."""
  need(
    c.hidden_act in HIDDEN_ACTS,
    f"hidden_act must be one of {HIDDEN_ACTS}, got {show(c.hidden_act)}",
  )
  need(
    is_real(c.final_logit_softcapping) and c.final_logit_softcapping >= 0,
    f"final_logit_softcapping must be ≥ 0 (0: none), got {show(c.final_logit_softcapping)}",
  )
  need(
    is_real(c.query_pre_attn_scalar)
    and math.isfinite(c.query_pre_attn_scalar)
    and c.query_pre_attn_scalar >= 0,
    f"query_pre_attn_scalar must be a finite number ≥ 0 (0: head_dim), got "
    f"{show(c.query_pre_attn_scalar)}",
  )
  features = (
    (
      family.global_attention,
      (c.global_head_dim, c.global_num_kv_heads, c.attention_k_eq_v),
      "full layers' own head width and KV heads (global_head_dim, global_num_kv_heads, "
      "attention_k_eq_v)",
      lambda f: f.global_attention,
    ),
    (
      family.kv_sharing,
      (c.num_kv_shared_layers, c.use_double_wide_mlp),
      "KV-shared layers (num_kv_shared_layers, use_double_wide_mlp)",
      lambda f: f.kv_sharing,
    ),
    (
      family.per_layer_inputs,
      (c.hidden_size_per_layer_input,),
      "per-layer inputs (hidden_size_per_layer_input)",
      lambda f: f.per_layer_inputs,
    ),
    (
      family.logit_softcapping,
      (c.final_logit_softcapping,),
      "logit soft-capping (final_logit_softcapping)",
      lambda f: f.logit_softcapping,
    ),
    (
      family.query_scalar,
      (c.query_pre_attn_scalar,),
      "the softmax scale query_pre_attn_scalar^-0.5 (query_pre_attn_scalar)",
      lambda f: f.query_scalar,
    ),
  )
  for has, values, what, feature in features:
    need(has or not any(values), f"{what}: a feature of {_of(feature)}")
  if family.moe_beside_mlp:
    need(
      all(c.layer_is_moe) or not any(c.layer_is_moe),
      "the MoE block beside the MLP is in every layer or in none (enable_moe_block)",
    )
  if family.kv_sharing:
    need(
      c.num_kv_shared_layers < c.num_layers,
      f"num_kv_shared_layers ({c.num_kv_shared_layers}) must leave a layer that computes "
      f"K/V (num_hidden_layers {c.num_layers})",
    )
    if c.num_kv_shared_layers:
      first = c.num_layers - c.num_kv_shared_layers
      kinds = {c.is_sliding(i) for i in range(first)}
      shared = {c.is_sliding(i) for i in range(first, c.num_layers)}
      need(
        shared <= kinds,
        "KV-shared layers of a type (sliding or full) no earlier layer has: nothing to share",
      )
  if family.global_attention:
    need(
      c.num_heads % c.attention_kv_heads(False) == 0,
      f"num_attention_heads ({c.num_heads}) must be a multiple of the full layers' KV "
      f"heads ({c.attention_kv_heads(False)})",
    )
  if family.per_layer_inputs:
    need(
      not c.hidden_size_per_layer_input or c.vocab_size_per_layer_input > 0,
      "per-layer inputs need vocab_size_per_layer_input > 0",
    )


def _validate_mla(c: Any, family: Family, need: Need) -> None:
  """MLA and DSA fields: present exactly where the family has them, and consistent."""
  need(
    family.mla == c.is_mla,
    f"kv_lora_rank > 0 (MLA) goes with exactly {_of(lambda f: f.mla)}",
  )
  if not family.mla:
    need(
      not (c.q_lora_rank or c.is_dsa or c.rope_interleave),
      "q_lora_rank, rope_interleave and the DSA indexer are MLA features",
    )
    return
  for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    need(getattr(c, name) > 0, f"{name} must be positive for MLA")
  need(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
  need(
    c.head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim,
    f"head_dim ({c.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
    f"({c.qk_nope_head_dim} + {c.qk_rope_head_dim}) for MLA",
  )
  need(
    c.num_kv_heads == c.num_heads,
    f"MLA expands the latent to every head: num_key_value_heads ({c.num_kv_heads}) must be "
    f"num_attention_heads ({c.num_heads})",
  )
  need(
    c.options.attention_impl != "pallas",
    "the Pallas attention kernel does not read MLA's latent cache; use attention_impl='xla'",
  )
  need(
    family.dsa == c.is_dsa,
    f"the DSA indexer (index_n_heads > 0) goes with exactly {_of(lambda f: f.dsa)}",
  )
  if not family.dsa:
    return
  need(c.q_lora_rank > 0, "the DSA indexer reads the q low-rank latent: q_lora_rank must be > 0")
  need(c.index_head_dim > 0, "index_head_dim must be positive")
  need(
    c.qk_rope_head_dim <= c.index_head_dim,
    f"index_head_dim ({c.index_head_dim}) must hold the RoPE part ({c.qk_rope_head_dim})",
  )
  need(c.index_topk > 0, "index_topk must be positive")
  need(
    isinstance(c.indexer_types, tuple)
    and len(c.indexer_types) == c.num_layers
    and all(t in INDEXER_TYPES for t in c.indexer_types),
    f"indexer_types must name {' or '.join(INDEXER_TYPES)} for each of the {c.num_layers} "
    f"layers, got {show(c.indexer_types)}",
  )
  need(
    c.indexer_types[0] == "full",
    "the first layer's indexer must be 'full': a 'shared' layer reuses an earlier choice",
  )
