"""A model's weights and decoding state as a list of named tensors, from its HF config.json.

The planner needs, for every weight, its path (which decides its quantization role,
`jaxspec.quant.policy.role_of`), shape, dtype and logical axes (which decide its sharding,
`jaxspec.sharding`); and for the decoding state the same per array. Two sources:

* **traced** — every architecture jaxspec builds (`io.architectures.config_from_hf`: Qwen3,
  Qwen3-MoE, GLM4-MoE, gpt-oss, Qwen3.5, and the MLA targets DeepSeek-V3 / Kimi-K2 / DeepSeek-V3.2
  / GLM-5). The parameter tree is `jax.eval_shape` of the model's own initialiser
  (`jaxspec.models.target.param_shapes` / `logical_axes`) and the state is `eval_shape` of
  `DecodingState.create` (the latent cache kinds of `jaxspec.state.latent` for MLA), so the
  planner counts exactly what the code allocates, and nothing is allocated.
* **formula** — the same entries written from the config's numbers, with jaxspec's path and
  axis conventions. It is kept as a cross-check (tests compare it with the traced tree) and for
  architectures named in config.json that jaxspec does not build.

Decoding state of the formula architectures, per sequence:

* MLA keeps the compressed latent, as serving engines do: kv_lora_rank + qk_rope_head_dim
  values per token and layer (one "head" of that width, so K and V share it); its format is a
  `jaxspec.state` kind with one KV head, counted once (no separate V).
* A Gated DeltaNet layer keeps a constant-size state: the causal-conv window, (kernel − 1) ×
  conv_dim values (conv_dim = 2·key_heads·key_dim + value_heads·value_dim), and the delta-rule
  state, value_heads × key_dim × value_dim float32 values. Only the full-attention layers
  (every `full_attention_interval`-th) keep a KV cache that grows with the context.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.config import ModelConfig
from jaxspec.family import Family, family_of, supported_architectures
from jaxspec.io.architectures import (
  MULTIMODAL_TEXT_ARCHITECTURES,
  HFConfigReader,
  config_from_hf,
  text_config,
)
from jaxspec.options import RunOptions
from jaxspec.errors import ConfigError
from jaxspec.state import DEFAULT_SLACK, KV_FORMATS, DecodingState, logical_axes

# Architectures jaxspec does not build that the planner counts by formula, each with the built
# architecture whose family (jaxspec.family: MLA, hybrid, ...) it shares.
FORMULA_ONLY = {
  "DeepseekV2ForCausalLM": "DeepseekV3ForCausalLM",
  "KimiK2ForCausalLM": "DeepseekV3ForCausalLM",
  "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",  # a flat config.json of it
}


def planned_architectures() -> tuple[str, ...]:
  """Every architecture the planner counts: those jaxspec builds, then FORMULA_ONLY's."""
  return supported_architectures() + tuple(FORMULA_ONLY)


def family(arch: str) -> Family:
  """The family of a planned architecture (FORMULA_ONLY's: that of the built one it names)."""
  return family_of(FORMULA_ONLY.get(arch, arch))


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One array: a "/"-joined path, its shape, dtype and logical axis names (None: unnamed)."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  axes: tuple[str | None, ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the planner knows about one model (see the module docstring).

  `dims` holds the numbers the activation and traffic models use: hidden, vocab, layers,
  attention layers, heads, kv_heads, head_dim, q_width (query width per token),
  kv_width (cached values per token and layer), intermediate, moe_layers, experts, top_k,
  moe_intermediate, shared_intermediate, linear_layers, linear_state (float32 values of one
  linear layer's recurrent state per sequence).
  """

  name: str
  architecture: str
  counted: str  # "traced" or "formula"
  weights: tuple[Tensor, ...]
  dims: Mapping[str, int]
  config: ModelConfig | None = None  # set when jaxspec can build the model
  hf: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def num_params(self) -> int:
    return sum(w.size for w in self.weights)

  @property
  def param_dtype(self) -> str:
    """The dtype of the unquantized weights (the embedding's) and of a float KV cache."""
    return next((w.dtype for w in self.weights if w.path == "embed"), "bfloat16")

  def state(
    self, batch: int, max_len: int, kv_format: str = "float", slack: int = DEFAULT_SLACK
  ) -> tuple[Tensor, ...]:
    """The target's decoding state for these shapes, per array (not per device); sliding-window
    layers keep rings of window + `slack` slots (the verify block), as the engine does."""
    if kv_format not in KV_FORMATS:
      raise ConfigError(f"kv_format={kv_format!r}; expected one of {tuple(KV_FORMATS)}")
    if self.config is not None:
      shapes = jax.eval_shape(
        lambda: DecodingState.create(self.config, batch, max_len, kv_format, slack=slack)
      )
      return _state_tensors(shapes, "state")
    return _formula_state(self, batch, max_len, kv_format)


def architecture_of(hf: Mapping[str, Any]) -> str:
  """The one architecture a config.json names; ConfigError when the planner cannot count it."""
  if not isinstance(hf, Mapping):
    raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
  archs = hf.get("architectures") or []
  planned = planned_architectures()
  if not isinstance(archs, (list, tuple)) or len(archs) != 1 or archs[0] not in planned:
    raise ConfigError(
      f"the planner cannot count architectures {archs!r}; it knows exactly one of "
      f"{', '.join(planned)}"
    )
  return archs[0]


def model_spec(
  hf: Mapping[str, Any], name: str = "", param_dtype: str = "bfloat16", source: str = "auto"
) -> ModelSpec:
  """The planner's view of the model a HF config.json describes.

  Args:
    hf: the config.json dict (a Qwen3.5 `text_config` nested inside is read).
    name: a label for tables.
    param_dtype: the dtype unquantized weights (and the float KV cache) are kept in.
    source: "traced" (jaxspec builds it; ConfigError otherwise), "formula", or "auto" (traced
      whenever jaxspec can build the architecture).
  """
  if isinstance(hf.get("text_config"), Mapping):
    outer = (hf.get("architectures") or [None])[0]
    if outer in MULTIMODAL_TEXT_ARCHITECTURES:  # a wrapper jaxspec reads the text model of
      hf = text_config(hf)
    else:
      hf = {**hf["text_config"], "architectures": hf.get("architectures")}
  arch = architecture_of(hf)
  buildable = arch in supported_architectures()
  if source not in ("auto", "traced", "formula"):
    raise ConfigError(f"source={source!r}; expected 'auto', 'traced' or 'formula'")
  if source == "traced" and not buildable:
    raise ConfigError(f"jaxspec cannot build {arch}; count it with source='formula'")
  dims = _dims(hf, arch)
  if buildable and source != "formula":
    config = config_from_hf(hf, options=RunOptions(dtype=param_dtype, param_dtype=param_dtype))
    return ModelSpec(name or arch, arch, "traced", traced_weights(config), dims, config, hf)
  return ModelSpec(name or arch, arch, "formula", formula_weights(hf, param_dtype), dims, None, hf)


def traced_weights(config: ModelConfig) -> tuple[Tensor, ...]:
  """Every parameter of the model jaxspec builds for `config`, from its traced initialiser."""
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  return tensors_of(target_lib.param_shapes(config), target_lib.logical_axes(config))


def tensors_of(shapes: Any, logical: Any) -> tuple[Tensor, ...]:
  """Tensors of a traced parameter tree (ShapeDtypeStructs) and its logical PartitionSpecs."""
  from jaxspec.quant.policy import path_str  # pylint: disable=import-outside-toplevel

  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  axes = jax.tree_util.tree_leaves(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return tuple(
    Tensor(path_str(p), tuple(x.shape), str(x.dtype), _padded(tuple(a), len(x.shape)))
    for (p, x), a in zip(leaves, axes)
  )


def _padded(axes: tuple, rank: int) -> tuple:
  return tuple(axes) + (None,) * (rank - len(axes))


def _state_tensors(tree: Any, prefix: str) -> tuple[Tensor, ...]:
  """State arrays with their logical axes, as the state kinds name them (`jaxspec.state`'s
  AXES tables: K/V [L, B, S, K, D], FP8 scales [L, B, S, K], lengths [B], ...)."""
  axes = jax.tree_util.tree_leaves(
    state_logical_axes(tree), is_leaf=lambda x: isinstance(x, PartitionSpec)
  )
  return tuple(
    Tensor(prefix + jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), tuple(spec))
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], axes)
  )


def state_logical_axes(tree: Any) -> Any:
  """Logical PartitionSpecs for a live `DecodingState` (for `jaxspec.sharding.shard_tree`)."""
  return logical_axes(tree)


def kv_kind_tensors(
  prefix: str,
  layers: int,
  batch: int,
  length: int,
  kv_heads: int,
  head_dim: int,
  kv_format: str,
  dtype: str,
  keys_only: bool = False,
) -> tuple[Tensor, ...]:
  """The arrays of a `jaxspec.state` KV kind for this geometry, traced (nothing allocated).

  `keys_only` keeps K (and its scale) alone: MLA's latent is read as both keys and values.
  """
  geometry = types.SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
  kind = KV_FORMATS[kv_format]
  shapes = jax.eval_shape(lambda: kind.create(geometry, layers, batch, length))
  tensors = _state_tensors(shapes, prefix)
  if keys_only:
    tensors = tuple(t for t in tensors if t.path.rsplit(".", 1)[-1] in ("k", "k_scale"))
  return tensors


def _formula_state(spec: ModelSpec, batch: int, max_len: int, kv_format: str) -> tuple:
  d, dtype = spec.dims, spec.param_dtype
  out = list(
    kv_kind_tensors(
      "state.kv",
      d["attention_layers"],
      batch,
      max_len,
      d["cache_heads"],
      d["cache_head_dim"],
      kv_format,
      dtype,
      keys_only=d["cache_heads"] == 1 and d.get("mla", 0) == 1,
    )
  )
  if family(spec.architecture).dsa:
    out += indexer_state(spec.hf, batch, max_len, kv_format, dtype)
  if d["linear_layers"]:
    out.append(
      Tensor(
        "state.conv",
        (d["linear_layers"], batch, d["conv_dim"], d["conv_window"]),
        dtype,
        ("layers", "batch", "heads", None),
      )
    )
    out.append(
      Tensor(
        "state.delta",
        (
          d["linear_layers"],
          batch,
          d["linear_value_heads"],
          d["linear_key_dim"],
          d["linear_value_dim"],
        ),
        "float32",
        ("layers", "batch", "heads", None, None),
      )
    )
  out.append(Tensor("state.lengths", (batch,), "int32", ("batch",)))
  return tuple(out)


# ------------------------------------------------------------------------------------------------
# Architecture numbers
# ------------------------------------------------------------------------------------------------


def _built(hf: Mapping[str, Any], arch: str) -> ModelConfig | None:
  """The config jaxspec builds for `hf` (its family's defaults applied); None for FORMULA_ONLY."""
  return config_from_hf(hf) if arch in supported_architectures() else None


def _dims(hf: Mapping[str, Any], arch: str) -> dict[str, int]:
  """The numbers the activation and traffic models read (see ModelSpec)."""
  r = HFConfigReader(hf, arch)
  c = _built(hf, arch)
  if c is not None:  # as the family reads them (defaults, the experts' width, ...)
    hidden, layers, heads, vocab = c.hidden_size, c.num_layers, c.num_heads, c.vocab_size
    kv_heads, head_dim = c.num_kv_heads, c.head_dim
    intermediate = r.integer("intermediate_size", c.intermediate_size)
    experts, moe_inter, top_k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
  else:
    r.require("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    hidden, layers = r.integer("hidden_size"), r.integer("num_hidden_layers")
    heads, vocab = r.integer("num_attention_heads"), r.integer("vocab_size")
    intermediate = r.integer("intermediate_size", 0)
    kv_heads = r.integer("num_key_value_heads", heads)
    head_dim = r.integer("head_dim", hidden // heads)
    experts = r.first_integer(("n_routed_experts", "num_experts", "num_local_experts"), 0)
    moe_inter = r.integer("moe_intermediate_size", 0)
    top_k = r.first_integer(("num_experts_per_tok", "experts_per_token", "top_k_experts"), 0)
  d: dict[str, Any] = dict(
    hidden=hidden,
    vocab=vocab,
    layers=layers,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
    q_width=heads * head_dim,
    intermediate=intermediate,
    experts=experts,
    top_k=top_k if experts else 0,
    moe_intermediate=moe_inter,
    shared_intermediate=0,
    moe_layers=0,
    attention_layers=layers,
    cache_heads=kv_heads,
    cache_head_dim=head_dim,
    linear_layers=0,
    mtp_layers=r.first_integer(("num_nextn_predict_layers", "mtp_num_hidden_layers"), 0),
  )
  fam = family(arch)
  if fam.mla:
    r.require("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    rope, nope = r.integer("qk_rope_head_dim"), r.integer("qk_nope_head_dim")
    d.update(
      mla=1,
      q_width=heads * (nope + rope),
      head_dim=nope + rope,
      v_head_dim=r.integer("v_head_dim"),
      cache_heads=1,
      cache_head_dim=r.integer("kv_lora_rank") + rope,
      moe_layers=(layers - r.integer("first_k_dense_replace", 0)) if experts else 0,
      shared_intermediate=moe_inter * r.integer("n_shared_experts", 0),
    )
  elif fam.hybrid:
    if c is not None:
      full = sum(t == "full_attention" for t in c.layer_types)
      kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
      kd, vd, kernel = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
      shared = c.shared_expert_intermediate_size
    else:
      r.require(
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
      )
      full = layers // r.integer("full_attention_interval", 4)
      kh, vh = r.integer("linear_num_key_heads"), r.integer("linear_num_value_heads")
      kd, vd = r.integer("linear_key_head_dim"), r.integer("linear_value_head_dim")
      kernel = r.integer("linear_conv_kernel_dim")
      shared = r.integer("shared_expert_intermediate_size", 0)
    d.update(
      attention_layers=full,
      linear_layers=layers - full,
      linear_key_heads=kh,
      linear_value_heads=vh,
      linear_key_dim=kd,
      linear_value_dim=vd,
      conv_dim=2 * kh * kd + vh * vd,
      conv_window=kernel - 1,
      moe_layers=layers if experts else 0,
      shared_intermediate=shared,
    )
  elif experts:
    config = config_from_hf(hf)
    d.update(
      moe_layers=sum(config.layer_is_moe),
      shared_intermediate=config.shared_intermediate_size,
    )
  return d


# ------------------------------------------------------------------------------------------------
# Parameter formulas
# ------------------------------------------------------------------------------------------------


class _Weights:
  """Collects formula weights under jaxspec's path and axis conventions."""

  def __init__(self, dtype: str):
    self.dtype = dtype
    self.items: list[Tensor] = []

  def add(self, path: str, shape: tuple[int, ...], axes: tuple, dtype: str = "") -> None:
    if math.prod(shape) > 0:
      self.items.append(Tensor(path, tuple(shape), dtype or self.dtype, tuple(axes)))

  def stack(self, prefix: str, n: int, name: str, shape: tuple, axes: tuple, dtype="") -> None:
    """A weight of each of the n layers of a scanned run (leading `layers` axis)."""
    self.add(f"{prefix}/{name}", (n, *shape), ("layers", *axes), dtype)


def _gqa_attention(
  w: _Weights, p: str, n: int, d: Mapping[str, int], r: HFConfigReader, arch, sliding=False
):
  h, q, kv, hd = d["hidden"], d["heads"], d["kv_heads"], d["head_dim"]
  vd = hd
  c = _built(r.hf, arch)
  if c is not None:  # the built config: per layer type shapes (MiMo's sliding layers), biases...
    hd, kv = c.attention_head_dim(sliding), c.attention_kv_heads(sliding)
    vd = c.attention_value_dim(sliding)
    q_bias, o_bias = c.attention_bias, c.attention_out_bias
    qk_norm = c.qk_norm_type if c.qk_norm else ""
    sinks = c.attention_sinks or (c.sliding_attention_sinks and sliding)
  else:  # counted by formula only: its family's
    q_bias = o_bias = r.flag("attention_bias", False)
    qk_norm = "per_head" if family(arch).hybrid else ""
    sinks = False
  gated = family(arch).hybrid and r.flag("attn_output_gate", True)
  w.stack(
    p,
    n,
    "self_attn/q_proj/kernel",
    (h, q * (2 if gated else 1), hd),
    ("embed", "heads", "head_dim"),
  )
  w.stack(p, n, "self_attn/k_proj/kernel", (h, kv, hd), ("embed", "kv_heads", "head_dim"))
  w.stack(p, n, "self_attn/v_proj/kernel", (h, kv, vd), ("embed", "kv_heads", "head_dim"))
  w.stack(p, n, "self_attn/o_proj/kernel", (q, vd, h), ("heads", "head_dim", "embed"))
  if q_bias:
    w.stack(p, n, "self_attn/q_proj/bias", (q, hd), ("heads", "head_dim"))
    w.stack(p, n, "self_attn/k_proj/bias", (kv, hd), ("kv_heads", "head_dim"))
    w.stack(p, n, "self_attn/v_proj/bias", (kv, hd), ("kv_heads", "head_dim"))
  if o_bias:
    w.stack(p, n, "self_attn/o_proj/bias", (h,), ("embed",))
  if qk_norm == "per_layer":  # over the whole q (k) projection (MiniMax-M2)
    w.stack(p, n, "self_attn/q_norm/scale", (q, hd), ("heads", "head_dim"))
    w.stack(p, n, "self_attn/k_norm/scale", (kv, hd), ("kv_heads", "head_dim"))
  elif qk_norm:
    w.stack(p, n, "self_attn/q_norm/scale", (hd,), ("head_dim",))
    w.stack(p, n, "self_attn/k_norm/scale", (hd,), ("head_dim",))
  if sinks:
    w.stack(p, n, "self_attn/sinks", (q,), ("heads",))


def _mla_attention(w: _Weights, p: str, n: int, d: Mapping[str, int], r: HFConfigReader):
  h, q = d["hidden"], d["heads"]
  qk, v = d["head_dim"], d["v_head_dim"]
  rope, lora = r.integer("qk_rope_head_dim"), r.integer("kv_lora_rank")
  q_lora = r.integer("q_lora_rank", 0)
  if q_lora:
    w.stack(p, n, "self_attn/q_a_proj/kernel", (h, q_lora), ("embed", "q_lora"))
    w.stack(p, n, "self_attn/q_a_layernorm/scale", (q_lora,), ("q_lora",))
    w.stack(p, n, "self_attn/q_b_proj/kernel", (q_lora, q, qk), ("q_lora", "heads", "head_dim"))
  else:
    w.stack(p, n, "self_attn/q_proj/kernel", (h, q, qk), ("embed", "heads", "head_dim"))
  w.stack(p, n, "self_attn/kv_a_proj_with_mqa/kernel", (h, lora + rope), ("embed", "kv_lora"))
  w.stack(p, n, "self_attn/kv_a_layernorm/scale", (lora,), ("kv_lora",))
  w.stack(
    p, n, "self_attn/kv_b_proj/kernel", (lora, q, qk - rope + v), ("kv_lora", "heads", "head_dim")
  )
  w.stack(p, n, "self_attn/o_proj/kernel", (q, v, h), ("heads", "head_dim", "embed"))


def _indexer(w: _Weights, p: str, n: int, d: Mapping[str, int], r: HFConfigReader):
  """DSA's lightning indexer (DeepSeek-V3.2, GLM-5): its own low-rank query heads, one key per
  token (LayerNorm'd) and a per-head weighting of the scores. Names and axes follow the indexer
  module (models/dsa.py)."""
  h, q_lora = d["hidden"], r.integer("q_lora_rank")
  heads, dim = r.integer("index_n_heads"), r.integer("index_head_dim")
  a = "self_attn/indexer"
  w.stack(p, n, f"{a}/wq_b/kernel", (q_lora, heads, dim), ("q_lora", "heads", "head_dim"))
  w.stack(p, n, f"{a}/wk/kernel", (h, dim), ("embed", "head_dim"))
  w.stack(p, n, f"{a}/k_norm/scale", (dim,), ("head_dim",))
  w.stack(p, n, f"{a}/k_norm/bias", (dim,), ("head_dim",))
  w.stack(p, n, f"{a}/weights_proj/kernel", (h, heads), ("embed", "heads"))


def indexer_state(
  hf: Mapping[str, Any], batch: int, max_len: int, kv_format: str, dtype: str
) -> tuple[Tensor, ...]:
  """The indexer's key cache of a DSA config: index_head_dim values per token in every layer
  that runs its indexer ("full" in `indexer_types`; "shared" layers reuse a selection), kept
  in the float dtype whatever the latent cache's format
  (state/indexer.py)."""
  del kv_format
  config = config_from_hf(hf)
  layers = sum(kind == "full" for kind in config.indexer_types)
  return kv_kind_tensors(
    "state.indexer", layers, batch, max_len, 1, config.index_head_dim, "float", dtype,
    keys_only=True,
  )


def _gated_deltanet(w: _Weights, p: str, n: int, d: Mapping[str, int]):
  h, kh, vh = d["hidden"], d["linear_key_heads"], d["linear_value_heads"]
  kd, vd = d["linear_key_dim"], d["linear_value_dim"]
  a = "self_attn/linear"  # the "attention" role: the token mixer of these layers
  w.stack(p, n, f"{a}/in_proj_qkvz/kernel", (h, 2 * kh * kd + 2 * vh * vd), ("embed", "heads"))
  w.stack(p, n, f"{a}/in_proj_ba/kernel", (h, 2 * vh), ("embed", "heads"))
  w.stack(p, n, f"{a}/conv1d/kernel", (d["conv_dim"], d["conv_window"] + 1), ("heads", None))
  w.stack(p, n, f"{a}/dt_bias", (vh,), ("heads",))
  w.stack(p, n, f"{a}/A_log", (vh,), ("heads",), "float32")
  w.stack(p, n, f"{a}/norm/scale", (vd,), ("head_dim",))
  w.stack(p, n, f"{a}/out_proj/kernel", (vh * vd, h), ("heads", "embed"))


def _ffn(w: _Weights, p: str, n: int, h: int, inter: int):
  """A dense SwiGLU feed-forward (role "mlp", or "shared_experts" under that prefix)."""
  w.stack(p, n, "gate_proj/kernel", (h, inter), ("embed", "mlp"))
  w.stack(p, n, "up_proj/kernel", (h, inter), ("embed", "mlp"))
  w.stack(p, n, "down_proj/kernel", (inter, h), ("mlp", "embed"))


def _moe(w: _Weights, p: str, n: int, d: Mapping[str, int], r: HFConfigReader, arch: str):
  h, e, inter = d["hidden"], d["experts"], d["moe_intermediate"]
  w.stack(p, n, "mlp/router", (h, e), ("embed", None), "float32")  # float32, as HF keeps it
  if family(arch).biased_experts:  # gpt-oss: biased, fused and interleaved gate/up
    w.stack(p, n, "mlp/router_bias", (e,), (None,), "float32")
    w.stack(p, n, "mlp/gate_up_proj", (e, h, 2 * inter), ("expert", "embed", "mlp"))
    w.stack(p, n, "mlp/gate_up_bias", (e, 2 * inter), ("expert", "mlp"))
    w.stack(p, n, "mlp/down_proj", (e, inter, h), ("expert", "mlp", "embed"))
    w.stack(p, n, "mlp/down_bias", (e, h), ("expert", "embed"))
    return
  c = _built(r.hf, arch)
  if c.router == "sigmoid" if c is not None else family(arch).mla:  # a routing-bias correction
    w.stack(p, n, "mlp/e_score_correction_bias", (e,), (None,), "float32")
  w.stack(p, n, "mlp/gate_proj", (e, h, inter), ("expert", "embed", "mlp"))
  w.stack(p, n, "mlp/up_proj", (e, h, inter), ("expert", "embed", "mlp"))
  w.stack(p, n, "mlp/down_proj", (e, inter, h), ("expert", "mlp", "embed"))
  if d["shared_intermediate"]:
    w.items += _stacked_ffn(f"{p}/mlp/shared_experts", n, h, d["shared_intermediate"], w.dtype)
  if family(arch).hybrid:
    w.stack(p, n, "mlp/shared_expert_gate/kernel", (h, 1), ("embed", None))


def _stacked_ffn(prefix: str, n: int, h: int, inter: int, dtype: str) -> list[Tensor]:
  w = _Weights(dtype)
  _ffn(w, prefix, n, h, inter)
  return w.items


def formula_weights(hf: Mapping[str, Any], param_dtype: str = "bfloat16") -> tuple[Tensor, ...]:
  """Every weight of the model `hf` describes, from the architecture's published structure.

  Counts what HF's reference implementation holds (embedding, attention or MLA or Gated
  DeltaNet, dense or routed + shared experts, norms, MTP layers, the LM head unless tied),
  with jaxspec's path and axis conventions; the axis names `q_lora` and `kv_lora` have no
  sharding rule, so those small low-rank projections stay replicated.
  """
  if isinstance(hf.get("text_config"), Mapping):
    outer = (hf.get("architectures") or [None])[0]
    if outer in MULTIMODAL_TEXT_ARCHITECTURES:  # a wrapper jaxspec reads the text model of
      hf = text_config(hf)
    else:
      hf = {**hf["text_config"], "architectures": hf.get("architectures")}
  arch = architecture_of(hf)
  r = HFConfigReader(hf, arch)
  d = _dims(hf, arch)
  h, layers = d["hidden"], d["layers"]
  w = _Weights(param_dtype)
  w.add("embed", (d["vocab"], h), ("vocab", "embed"))
  # Which layers are MoE: the same rules as config_from_hf for the buildable ones.
  fam, buildable = family(arch), arch in supported_architectures()
  if buildable:
    is_moe = config_from_hf(hf).layer_is_moe or (False,) * layers
  elif d["experts"]:
    first = r.integer("first_k_dense_replace", 0) if fam.mla else 0
    is_moe = tuple(i >= first for i in range(layers))
  else:
    is_moe = (False,) * layers
  if fam.hybrid:
    interval = r.integer("full_attention_interval", 4)
    kinds = tuple(
      ("full" if (i + 1) % interval == 0 else "linear", m) for i, m in enumerate(is_moe)
    )
  elif fam.dsa:
    indexed = config_from_hf(hf).indexer_types
    kinds = tuple(("dsa" if t == "full" else "full", m) for t, m in zip(indexed, is_moe))
  else:
    kinds = tuple(("full", m) for m in is_moe)
  # Sliding and full layers are separate runs (as `ModelConfig.segments`).
  windows = config_from_hf(hf).layer_windows if buildable else ()
  kinds = tuple((*k, windows[i] if windows else 0) for i, k in enumerate(kinds))
  runs: list[list] = []
  for kind in kinds:
    if runs and runs[-1][0] == kind:
      runs[-1][1] += 1
    else:
      runs.append([kind, 1])
  for s, ((mixer, moe, window), n) in enumerate(runs):
    p = f"layers_{s}"
    _layer(w, p, n, d, r, arch, mixer, moe, sliding=window > 0)
  for m in range(d["mtp_layers"]):
    p = f"mtp_{m}"
    w.add(f"{p}/eh_proj/kernel", (2 * h, h), ("mlp", "embed"))
    for norm in ("enorm", "hnorm", "post_norm"):
      w.add(f"{p}/{norm}/scale", (h,), ("embed",))
    block = _Weights(param_dtype)
    mixer = "dsa" if fam.dsa else "full"
    sliding = fam.mtp_sliding  # MiMo's: a sliding block with a dense MLP
    _layer(block, f"{p}/block", 1, d, r, arch, mixer, d["experts"] > 0 and not sliding, sliding)
    w.items += [  # one layer, no leading `layers` axis
      Tensor(t.path, t.shape[1:], t.dtype, t.axes[1:]) for t in block.items
    ]
  w.add("norm/scale", (h,), ("embed",))
  tied = config_from_hf(hf).tie_word_embeddings if buildable else None
  if not (r.flag("tie_word_embeddings", False) if tied is None else tied):
    w.add("lm_head/kernel", (h, d["vocab"]), ("embed", "vocab"))
  return tuple(w.items)


def _layer(
  w: _Weights, p: str, n: int, d, r, arch: str, mixer: str, moe: bool, sliding: bool = False
) -> None:
  h = d["hidden"]
  w.stack(p, n, "input_layernorm/scale", (h,), ("embed",))
  w.stack(p, n, "post_attention_layernorm/scale", (h,), ("embed",))
  if mixer == "linear":
    _gated_deltanet(w, p, n, d)
  elif family(arch).mla:
    _mla_attention(w, p, n, d, r)
    if mixer == "dsa":
      _indexer(w, p, n, d, r)
  else:
    _gqa_attention(w, p, n, d, r, arch, sliding)
  if moe:
    _moe(w, p, n, d, r, arch)
  else:
    w.items += _stacked_ffn(f"{p}/mlp", n, h, d["intermediate"], w.dtype)
  if family(arch).sandwich_norms:  # the MLP's input and output norms (Gemma)
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
      w.stack(p, n, f"{norm}/scale", (h,), ("embed",))
  if family(arch).layer_scalar:
    w.stack(p, n, "layer_scalar", (1,), (None,))
