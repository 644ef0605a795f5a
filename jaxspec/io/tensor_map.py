"""The HF tensor-name map of a target: each checkpoint tensor's name ↔ its jaxspec parameter path.

Names are built from the config's features (MLA, DSA indexer, linear-attention layers, fused
experts, q/k norms, sinks, sliding and KV-shared layers, MTP layers) and from the family's
`TensorLayout` (`ARCHITECTURES[config.architecture].tensors`): the names and renames families
publish differently. Nothing here branches on the architecture's name. On-disk names are the HF
ones (`model.layers.{i}.self_attn.q_proj.weight`, per-expert `mlp.experts.{e}.gate_proj.weight`,
...); MTP layers follow the family's `mtp_prefix`. Each entry names a kind that says how the
tensor is reshaped between the two layouts (`jaxspec.io.layouts`).
"""

from __future__ import annotations

from typing import Iterator

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import ARCHITECTURES
from jaxspec.io.architectures.tensors import Entry, TensorLayout

MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# Per-layer input embeddings (hidden_size_per_layer_input): each layer's gate, projection, norm.
PER_LAYER_INPUT: list[Entry] = [
  ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), "linear"),
  ("per_layer_projection.weight", ("per_layer_projection", "kernel"), "linear"),
  ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), "same"),
]


def tensor_layout(config: ModelConfig) -> TensorLayout:
  """The checkpoint names of `config`'s family."""
  return ARCHITECTURES[config.architecture].tensors


def _linear_attn_entries(config: ModelConfig) -> list[Entry]:
  """A Gated DeltaNet layer's tensors (the family's input projections, then the shared ones)."""
  e: list[Entry] = [
    (f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), "linear")
    for p in tensor_layout(config).linear_attention
  ]
  return e + [
    ("linear_attn.conv1d.weight", ("linear_attn", "conv_kernel"), "conv"),
    ("linear_attn.dt_bias", ("linear_attn", "dt_bias"), "same"),
    ("linear_attn.A_log", ("linear_attn", "A_log"), "same"),
    ("linear_attn.norm.weight", ("linear_attn", "norm"), "same"),
    ("linear_attn.out_proj.weight", ("linear_attn", "out_proj", "kernel"), "linear"),
  ]


def layer_entries(
  config: ModelConfig,
  moe: bool,
  linear: bool = False,
  indexer: bool = False,
  sliding: bool = False,
  kv_shared: bool = False,
) -> list[Entry]:
  """A decoder layer's tensors, relative to `model.layers.{i}.`, for the layer kind given."""
  e: list[Entry] = [
    ("input_layernorm.weight", ("input_layernorm", "scale"), "same"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), "same"),
  ]
  if linear:
    e += _linear_attn_entries(config)
  else:
    e += _attention_entries(config, sliding, kv_shared)
  if indexer:
    e += _indexer_entries()
  e += tensor_layout(config).layer_extras
  if config.hidden_size_per_layer_input:
    e += PER_LAYER_INPUT
  return e + _ffn_entries(config, moe)


def _mla_entries(config: ModelConfig) -> list[Entry]:
  """An MLA layer's tensors (DeepSeek-V3 names; models/mla.py)."""
  a = lambda name: ("self_attn", name, "kernel")
  if config.q_lora_rank:
    e: list[Entry] = [
      ("self_attn.q_a_proj.weight", a("q_a_proj"), "linear"),
      ("self_attn.q_a_layernorm.weight", ("self_attn", "q_a_layernorm", "scale"), "same"),
      ("self_attn.q_b_proj.weight", a("q_b_proj"), "in_heads"),
    ]
  else:
    e = [("self_attn.q_proj.weight", a("q_proj"), "in_heads")]
  e += [
    ("self_attn.kv_a_proj_with_mqa.weight", a("kv_a_proj_with_mqa"), "linear"),
    ("self_attn.kv_a_layernorm.weight", ("self_attn", "kv_a_layernorm", "scale"), "same"),
    ("self_attn.kv_b_proj.weight", a("kv_b_proj"), "in_heads"),
    ("self_attn.o_proj.weight", a("o_proj"), "out_heads"),
  ]
  if config.attention_bias:
    biased = ("q_a_proj",) if config.q_lora_rank else ()
    e += [
      (f"self_attn.{p}.bias", ("self_attn", p, "bias"), "same")
      for p in (*biased, "kv_a_proj_with_mqa", "o_proj")
    ]
  return e


def _indexer_entries() -> list[Entry]:
  """A DSA layer's lightning indexer (models/dsa.py), under self_attn.indexer."""
  i = lambda *path: ("self_attn", "indexer", *path)
  return [
    ("self_attn.indexer.wq_b.weight", i("wq_b", "kernel"), "in_heads"),
    ("self_attn.indexer.wk.weight", i("wk", "kernel"), "linear"),
    ("self_attn.indexer.k_norm.weight", i("k_norm", "scale"), "same"),
    ("self_attn.indexer.k_norm.bias", i("k_norm", "bias"), "same"),
    ("self_attn.indexer.weights_proj.weight", i("weights_proj", "kernel"), "linear"),
  ]


def _attention_entries(
  config: ModelConfig, sliding: bool = False, kv_shared: bool = False
) -> list[Entry]:
  if config.is_mla:
    return _mla_entries(config)
  # KV-shared layers have no K/V projections, full layers none for V where k_eq_v (Gemma 4).
  projections = ("q_proj",) if kv_shared else ("q_proj", "k_proj", "v_proj")
  if config.attention_k_eq_v and not sliding:
    projections = tuple(p for p in projections if p != "v_proj")
  e: list[Entry] = [
    (f"self_attn.{p}.weight", ("self_attn", p, "kernel"), "in_heads") for p in projections
  ]
  e.append(("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "out_heads"))
  if config.attention_bias:
    e += [
      (f"self_attn.{p}.bias", ("self_attn", p, "bias"), "bias_heads") for p in projections
    ]
  if config.attention_out_bias:
    e.append(("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "same"))
  if config.qk_norm:
    # per_layer (MiniMax-M2): HF [heads*D] ↔ jaxspec [heads, D]
    norm_kind = "bias_heads" if config.qk_norm_type == "per_layer" else "same"
    e += [
      (f"self_attn.{n}.weight", ("self_attn", n, "scale"), norm_kind)
      for n in (("q_norm",) if kv_shared else ("q_norm", "k_norm"))
    ]
  if config.attention_sinks or (config.sliding_attention_sinks and sliding):
    e.append((f"self_attn.{tensor_layout(config).sink}", ("self_attn", "sinks"), "same"))
  return e


def _ffn_entries(config: ModelConfig, moe: bool) -> list[Entry]:
  layout = tensor_layout(config)
  dense: list[Entry] = [(f"mlp.{p}.weight", ("mlp", p, "kernel"), "linear") for p in MLP_NAMES]
  if layout.moe_beside_mlp:  # the dense MLP in every layer, the MoE block beside it
    return dense + (list(layout.moe_beside_mlp) if moe else [])
  if config.fused_gate_up:  # gpt-oss: stacked experts in jaxspec's own [E, in, out] layout
    return [
      ("mlp.router.weight", ("mlp", "router"), "linear"),
      ("mlp.router.bias", ("mlp", "router_bias"), "same"),
      ("mlp.experts.gate_up_proj", ("mlp", "gate_up_proj"), "same"),
      ("mlp.experts.gate_up_proj_bias", ("mlp", "gate_up_bias"), "same"),
      ("mlp.experts.down_proj", ("mlp", "down_proj"), "same"),
      ("mlp.experts.down_proj_bias", ("mlp", "down_bias"), "same"),
    ]
  if not moe:
    return dense
  block = layout.moe_block
  e: list[Entry] = [(f"{block}.gate.weight", ("mlp", "router"), "linear")]
  if config.router == "sigmoid":
    e.append((f"{block}.{layout.router_bias}", ("mlp", "e_score_correction_bias"), "same"))
  for x in range(config.num_experts):
    e += [
      (f"{block}.experts.{x}.{name}.weight", ("mlp", p, f"#{x}"), "linear")
      for name, p in zip(layout.experts, MLP_NAMES)
    ]
  if config.n_shared_experts:
    e += [
      (f"mlp.shared_experts.{p}.weight", ("mlp", "shared_experts", p, "kernel"), "linear")
      for p in MLP_NAMES
    ]
  if config.shared_expert_intermediate_size:
    e += [
      (f"mlp.shared_expert.{p}.weight", ("mlp", "shared_expert", p, "kernel"), "linear")
      for p in MLP_NAMES
    ]
    e.append(("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), "linear"))
  return e


def _mtp_entries(config: ModelConfig) -> list[Entry]:
  """An MTP layer's tensors, relative to `mtp_prefix`: its own, then its decoder block's."""
  layout = tensor_layout(config)
  enorm, hnorm, eh_proj, post_norm = layout.mtp_names
  e: list[Entry] = [
    (f"{enorm}.weight", ("enorm", "scale"), "same"),
    (f"{hnorm}.weight", ("hnorm", "scale"), "same"),
    (f"{eh_proj}.weight", ("eh_proj", "kernel"), "linear"),
    (f"{post_norm}.weight", ("post_norm", "scale"), "same"),
  ]
  for own, name, entry in (
    (config.mtp_own_embed, layout.mtp_embed, (("embed",), "same")),
    (config.mtp_own_head, layout.mtp_head, (("head", "kernel"), "linear")),
  ):
    if own and not name:
      raise ConfigError(
        f"{config.architecture}: its MTP layers hold no embedding or head of their own"
      )
    if own:
      e.append((name, *entry))
  layer = layer_entries(
    config, config.mtp_is_moe, indexer=config.is_dsa, sliding=config.mtp_sliding
  )
  renames = dict(layout.mtp_renames)
  return e + [
    (layout.mtp_block + renames.get(hf, hf), ("block", *path), kind) for hf, path, kind in layer
  ]


def tensor_map(config: ModelConfig) -> Iterator[tuple[str, tuple, int | None, str]]:
  """Yields (hf_name, param path, index into the stacked layer axis or None, kind)."""
  yield "model.embed_tokens.weight", ("embed",), None, "same"
  yield "model.norm.weight", ("norm", "scale"), None, "same"
  if not config.tie_word_embeddings:
    yield "lm_head.weight", ("lm_head", "kernel"), None, "linear"
  if config.hidden_size_per_layer_input:
    yield "model.embed_tokens_per_layer.weight", ("embed_per_layer",), None, "same"
    projection = ("per_layer_model_projection", "kernel")
    yield "model.per_layer_model_projection.weight", projection, None, "linear"
    norm = ("per_layer_projection_norm", "scale")
    yield "model.per_layer_projection_norm.weight", norm, None, "same"
  for s, (first, n, moe) in enumerate(config.segments()):
    indexer = config.is_dsa and config.is_full_indexer(first)
    entries = layer_entries(
      config,
      moe,
      config.is_linear(first),
      indexer,
      config.is_sliding(first),
      config.is_kv_shared(first),
    )
    for j in range(n):
      for hf, path, kind in entries:
        yield f"model.layers.{first + j}.{hf}", (f"layers_{s}", *path), j, kind
  for k in range(config.num_mtp_layers):
    for hf, path, kind in _mtp_entries(config):
      yield f"{mtp_prefix(config, k)}{hf}", (f"mtp_{k}", *path), None, kind


def mtp_copies(config: ModelConfig) -> dict[str, str]:
  """{an MTP layer's published embedding / LM head: the main tensor it copies} for the copies
  `config` shares with the main model (DeepSeek-V3 and GLM publish `embed_tokens.weight` and
  `shared_head.head.weight` in each MTP layer; `TensorLayout.mtp_embed` / `mtp_head`)."""
  layout = tensor_layout(config)
  main_embed = "model.embed_tokens.weight"
  main_head = main_embed if config.tie_word_embeddings else "lm_head.weight"
  out = {}
  for k in range(config.num_mtp_layers):
    if layout.mtp_embed and not config.mtp_own_embed:
      out[mtp_prefix(config, k) + layout.mtp_embed] = main_embed
    if layout.mtp_head and not config.mtp_own_head:
      out[mtp_prefix(config, k) + layout.mtp_head] = main_head
  return out


def mtp_prefix(config: ModelConfig, k: int) -> str:
  """Where MTP layer k's tensors live (the family's `TensorLayout.mtp_prefix`)."""
  return tensor_layout(config).mtp_prefix.format(k=k, layer=config.num_layers + k)
