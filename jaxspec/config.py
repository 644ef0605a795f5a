"""The frozen `ModelConfig`: what a target model's architecture is.

Configs are immutable and hashable so that they can be static arguments of jitted functions and
attributes of Flax modules. Reading and writing a Hugging Face `config.json` is the io layer's
job (jaxspec.io.architectures: one small mapping per architecture family); this module only says
what a valid architecture is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxspec import config_checks
from jaxspec.errors import ConfigError, is_int
from jaxspec.family import Family, family_of
from jaxspec.options import RunOptions, option_names


def gpt_oss_windows(num_layers: int, window: int) -> tuple[int, ...]:
  """gpt-oss's default layer pattern: sliding-window attention at even layers, full at odd."""
  return tuple(window if i % 2 == 0 else 0 for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only target (dense or MoE), in jaxspec's own terms.

  Attributes mirror the HF names where one exists. `layer_is_moe[i]` says whether layer i has
  routed experts; it folds `first_k_dense_replace`, `decoder_sparse_step` and `mlp_only_layers`.
  The rule behind it is kept so that the layout can be re-derived at another depth (`replace`):
  Glm4Moe layers are dense first, then MoE (`first_k_dense_replace` = the number of leading dense
  layers); Qwen3-MoE layers are MoE at every `decoder_sparse_step`-th layer except the dense ones
  there (`mlp_only_layers`).
  """

  architecture: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # RoPE scaling, normalized by io.architectures' HFConfigReader.rope_scaling: () = none, else
  # sorted (name, value) pairs of a scaling type (models/layers.py: rope_frequencies).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  partial_rotary_factor: float = 1.0
  attention_bias: bool = False  # biases on q/k/v projections
  attention_out_bias: bool = False  # bias on o_proj (Qwen3 ties it to attention_bias; GLM never)
  qk_norm: bool = True
  # "per_head": one RMSNorm of head_dim shared by the heads (Qwen3); "per_layer": one RMSNorm
  # over the whole q (k) projection, num_heads × head_dim wide (MiniMax-M2).
  qk_norm_type: str = "per_head"
  # A constant factor on the value vectors before they are stored (MiMo-V2-Flash's
  # attention_value_scale).
  attention_value_scale: float = 1.0
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  # Mixture of experts (num_experts == 0 means dense).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  # "softmax" (Qwen3-MoE), "sigmoid" (GLM/DeepSeek: grouped, bias-corrected choice),
  # "topk_softmax" (gpt-oss: biased logits, top-k, softmax over the k chosen) or "gemma4"
  # (Gemma 4: softmax over the logits of the RMS-normed, scaled layer input; the renormalised
  # top-k weights times a learned per-expert scale).
  router: str = "softmax"
  norm_topk_prob: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  layer_is_moe: tuple[bool, ...] = ()
  decoder_sparse_step: int = 1  # Qwen3-MoE: only layers i with (i + 1) % step == 0 may be MoE
  # gpt-oss experts: biased projections, gate and up fused and interleaved in one [E, H, 2I]
  # weight, and the clamped SwiGLU (clip(up, ±limit) + 1) · g · σ(alpha · g), g = min(gate, limit)
  # (swiglu_limit 0: the plain SwiGLU silu(gate) · up).
  expert_bias: bool = False
  swiglu_limit: float = 0.0
  swiglu_alpha: float = 1.702
  # Attention variants (gpt-oss): per-layer sliding windows (a key is seen iff its position is
  # > the query's − window; 0 = full attention), one per layer (empty: all full), and learned
  # per-head sink logits that join every softmax's denominator.
  layer_windows: tuple[int, ...] = ()
  attention_sinks: bool = False
  # MiMo-V2-Flash: sinks in the sliding layers only (attention_sinks: in every layer), and the
  # sliding layers' own KV head count and RoPE base (0: num_kv_heads / rope_theta).
  sliding_attention_sinks: bool = False
  sliding_num_kv_heads: int = 0
  sliding_rope_theta: float = 0.0
  # Hybrid targets (Family.hybrid): each layer's token mixer, "full_attention" or
  # "linear_attention" (Gated DeltaNet; empty: all full), and the linear layers' shapes.
  layer_types: tuple[str, ...] = ()
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  # Qwen3-Next / Qwen3.5-MoE shared expert: one SwiGLU of this width, gated by
  # sigmoid(x · w_gate) (0: none).
  shared_expert_intermediate_size: int = 0
  # Multi-token-prediction layers stored after the main layers (DeepSeek-V3 layout).
  num_mtp_layers: int = 0
  # Whether the MTP layers read their own token embedding / LM head (the `embed_tokens` and
  # `shared_head.head` that DeepSeek-V3 and GLM publish in each MTP layer) instead of the
  # main model's. Set at load when a published copy differs from the main tensor
  # (io/hf.py: `load_model`); equal copies are shared, never held twice.
  mtp_own_embed: bool = False
  mtp_own_head: bool = False
  # Multi-head Latent Attention (Family.mla; kv_lora_rank 0: not MLA). Keys and values
  # come from a per-token latent of kv_lora_rank values plus one shared RoPE key of
  # qk_rope_head_dim; head_dim is qk_nope_head_dim + qk_rope_head_dim, values have v_head_dim.
  q_lora_rank: int = 0  # 0: a plain q_proj, else q_a_proj → q_a_layernorm → q_b_proj
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False  # RoPE on interleaved feature pairs (DeepSeek's layout)
  # DeepSeek Sparse Attention (Family.dsa): the lightning indexer picks each query's
  # index_topk keys; "shared" layers reuse the previous "full" layer's choice (index_n_heads 0:
  # dense attention).
  index_n_heads: int = 0
  index_head_dim: int = 0
  index_topk: int = 0
  indexer_types: tuple[str, ...] = ()
  indexer_rope_interleave: bool = False  # GLM-5: interleaved; DeepSeek-V3.2: half-split
  # Gemma 4 (its Family features). Full-attention layers' own head width and KV heads (0:
  # head_dim / num_kv_heads), and values equal to keys there (attention_k_eq_v: no v_proj);
  # the last num_kv_shared_layers layers compute no K/V and read those of the last earlier
  # layer of their type; per-layer input embeddings of hidden_size_per_layer_input values per
  # layer from a vocab_size_per_layer_input table (0: none); tanh soft-capping of the logits
  # (0: none); MLPs twice as wide in KV-shared layers (use_double_wide_mlp).
  global_head_dim: int = 0
  global_num_kv_heads: int = 0
  attention_k_eq_v: bool = False
  num_kv_shared_layers: int = 0
  hidden_size_per_layer_input: int = 0
  vocab_size_per_layer_input: int = 0
  final_logit_softcapping: float = 0.0
  use_double_wide_mlp: bool = False
  # Gemma 3 (Family.query_scalar): the softmax scale is query_pre_attn_scalar^-0.5 (0: head_dim's).
  query_pre_attn_scalar: float = 0.0
  # The dense MLP's activation (HIDDEN_ACTS).
  hidden_act: str = "silu"
  # Special tokens.
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  # How jaxspec runs the model (kernels, chunks, layout, dtypes): not part of the architecture,
  # never read from or written to config.json (jaxspec/options.py).
  options: RunOptions = RunOptions()

  def __post_init__(self):
    config_checks.check_types(self)  # before layer_is_moe is derived from num_layers and the sparse step
    if not self.layer_types:
      object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if not self.indexer_types and self.index_n_heads:
      object.__setattr__(self, "indexer_types", ("full",) * self.num_layers)
    else:
      object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
    if not self.layer_windows:
      object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
    else:
      object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
    if not self.layer_is_moe:
      object.__setattr__(
        self,
        "layer_is_moe",
        tuple(
          self.num_experts > 0 and (i + 1) % max(self.decoder_sparse_step, 1) == 0
          for i in range(self.num_layers)
        ),
      )
    else:
      object.__setattr__(self, "layer_is_moe", tuple(bool(m) for m in self.layer_is_moe))
    self.validate()

  @property
  def dtype(self) -> str:
    """`options.dtype`, the activations' dtype: read (not deprecated) by the layers that drafter
    configs share, which carry their own `dtype`; set it through the options."""
    return self.options.dtype

  @property
  def param_dtype(self) -> str:
    """`options.param_dtype`, the stored parameters' dtype (read-only, as `dtype`)."""
    return self.options.param_dtype

  def with_options(self, **changes: Any) -> "ModelConfig":
    """A copy whose run options have `changes` applied (`RunOptions` field names)."""
    return dataclasses.replace(self, options=self.options.replace(**changes))

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def family(self) -> Family:
    """The mechanisms of this architecture's family (jaxspec.family), which model code,
    validation, the planner and quantization branch on."""
    return family_of(self.architecture)

  @property
  def fused_gate_up(self) -> bool:
    """Experts hold gate and up as one [E, H, 2I] weight: interleaved (gpt-oss), or gate then
    up (Gemma 4); `family.fused_gate_up` says which."""
    return bool(self.family.fused_gate_up)

  @property
  def is_hybrid(self) -> bool:
    """Qwen3-Next / Qwen3.5: zero-centred norms, gated attention output, maybe linear layers."""
    return self.family.hybrid

  @property
  def norm_offset(self) -> float:
    """RMSNorm weights are stored as w with scale 1 + w (zero-centred) in hybrid targets and
    families with `centred_norms` (Gemma 3)."""
    return 1.0 if self.is_hybrid or self.family.centred_norms else 0.0

  @property
  def attention_output_gate(self) -> bool:
    """Full attention with an output gate: q_proj also yields a per-head gate, out ⊙ σ(gate)."""
    return self.is_hybrid

  def is_linear(self, layer: int) -> bool:
    """Whether layer `layer` is a Gated DeltaNet (linear-attention) layer."""
    return self.layer_types[layer] == "linear_attention"

  @property
  def sliding_window(self) -> int:
    """The largest per-layer window (0: every layer attends to the whole context)."""
    return max(self.layer_windows, default=0)

  @property
  def rotary_dim(self) -> int:
    if self.is_mla:  # RoPE rotates only the decoupled rope part of each head
      return self.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def is_mla(self) -> bool:
    """Multi-head Latent Attention (models/mla.py): a latent cache, not per-head K/V."""
    return self.kv_lora_rank > 0

  @property
  def is_dsa(self) -> bool:
    """DeepSeek Sparse Attention: MLA whose queries attend to their indexer's top-k keys."""
    return self.index_n_heads > 0

  @property
  def value_head_dim(self) -> int:
    """The attention output's per-head width: v_head_dim (MLA; MiMo-V2-Flash's values are
    narrower than its keys) when stated, else head_dim."""
    return self.v_head_dim or self.head_dim

  def is_sliding(self, layer: int) -> bool:
    """Whether attention layer `layer` sees only a sliding window of keys."""
    return self.layer_windows[layer] > 0

  def layer_kv_heads(self, layer: int) -> int:
    """KV heads of attention layer `layer` (MiMo's sliding layers, Gemma 4's full layers have
    their own count)."""
    return self.attention_kv_heads(self.is_sliding(layer))

  def attention_kv_heads(self, sliding: bool) -> int:
    """KV heads of the sliding (or full) attention layers."""
    if sliding and self.sliding_num_kv_heads:
      return self.sliding_num_kv_heads
    if not sliding and self.global_num_kv_heads:
      return self.global_num_kv_heads
    return self.num_kv_heads

  def attention_head_dim(self, sliding: bool) -> int:
    """Query/key width of the sliding (or full) attention layers (Gemma 4's full layers are
    `global_head_dim` wide)."""
    return self.global_head_dim if not sliding and self.global_head_dim else self.head_dim

  def attention_value_dim(self, sliding: bool) -> int:
    """Value width of the sliding (or full) attention layers."""
    return self.v_head_dim or self.attention_head_dim(sliding)

  def layer_head_dim(self, layer: int) -> int:
    return self.attention_head_dim(self.is_sliding(layer))

  def layer_value_head_dim(self, layer: int) -> int:
    return self.attention_value_dim(self.is_sliding(layer))

  @property
  def embedding_scale(self) -> float:
    """The factor on token embeddings as they enter the model (Gemma: sqrt(hidden_size));
    drafters that embed tokens with the target's table apply it too."""
    return self.hidden_size**0.5 if self.family.embedding_scale else 1.0

  def is_kv_shared(self, layer: int) -> bool:
    """Whether layer `layer` reads another layer's K/V instead of computing its own (Gemma 4's
    last `num_kv_shared_layers`)."""
    return layer >= self.num_layers - self.num_kv_shared_layers

  def kv_source(self, layer: int) -> int:
    """The layer whose K/V a KV-shared layer reads: the last layer of its type (sliding or
    full) before the shared ones."""
    first_shared = self.num_layers - self.num_kv_shared_layers
    sliding = self.is_sliding(layer)
    for i in range(first_shared - 1, -1, -1):
      if self.is_sliding(i) == sliding:
        return i
    raise ConfigError(
      f"{self.architecture}: layer {layer} shares K/V but no earlier layer of its type has any"
    )

  def segment_of(self, layer: int) -> int:
    """The index of the run (`segments()`) that holds layer `layer`."""
    for i, (first, n, _) in enumerate(self.segments()):
      if first <= layer < first + n:
        return i
    raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")

  def layer_mlp_width(self, layer: int) -> int:
    """The dense MLP's width in layer `layer` (Gemma 4: doubled in KV-shared layers)."""
    double = self.use_double_wide_mlp and self.is_kv_shared(layer)
    return self.intermediate_size * (2 if double else 1)

  def layer_rope(self, layer: int) -> tuple[int, float, tuple]:
    """(rotary dim, RoPE base, rope_scaling) of layer `layer`: the config's own, MiMo's
    sliding base; Gemma 4's sliding layers turn whole heads with their base and no scaling,
    its full layers are turned over `global_head_dim` by `rope_scaling` (proportional)."""
    if self.family.per_type_rope:
      if self.is_sliding(layer):
        return self.head_dim, self.sliding_rope_theta or self.rope_theta, ()
      return self.layer_head_dim(layer), self.rope_theta, self.rope_scaling
    return self.rotary_dim, self.layer_rope_theta(layer), self.rope_scaling

  def layer_rope_theta(self, layer: int) -> float:
    """The RoPE base of layer `layer` (MiMo's sliding layers have their own)."""
    if self.is_sliding(layer) and self.sliding_rope_theta:
      return self.sliding_rope_theta
    return self.rope_theta

  def has_sinks(self, layer: int) -> bool:
    """Whether attention layer `layer` has learned per-head sink logits."""
    return self.attention_sinks or (self.sliding_attention_sinks and self.is_sliding(layer))

  @property
  def latent_dim(self) -> int:
    """Values per token and layer in an MLA cache: the latent and the shared RoPE key."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def attention_scale(self) -> float:
    """The softmax scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)² under DeepSeek's
    YaRN (MLA targets; transformers' `yarn_apply_mscale`); 1 for Gemma 4, whose q/k norms
    set the scale (`family.unit_attention_scale`); query_pre_attn_scalar^-0.5 where stated
    (Gemma 3)."""
    if self.family.unit_attention_scale:
      return 1.0
    if self.query_pre_attn_scalar:
      return self.query_pre_attn_scalar**-0.5
    scale = self.head_dim**-0.5
    s = dict(self.rope_scaling)
    if self.is_mla and s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
      factor = s["factor"]
      m = 1.0 if factor <= 1 else 0.1 * s["mscale_all_dim"] * math.log(factor) + 1.0
      scale *= m * m
    return scale

  def is_full_indexer(self, layer: int) -> bool:
    """Whether DSA layer `layer` runs its own indexer (else it reuses the previous one's)."""
    return self.indexer_types[layer] == "full"

  @property
  def shared_intermediate_size(self) -> int:
    return self.moe_intermediate_size * self.n_shared_experts

  @property
  def mtp_is_moe(self) -> bool:
    """MTP blocks use routed experts whenever the model has them (HF and DeepSeek convention),
    except MiMo-V2-Flash's, whose MTP blocks have a dense MLP."""
    return self.is_moe and not self.mtp_sliding

  @property
  def mtp_sliding(self) -> bool:
    """MTP blocks with the sliding layers' attention (MiMo-V2-Flash: window, KV heads, sinks,
    RoPE base of its sliding layers)."""
    return self.family.mtp_sliding

  def segments(self) -> tuple[tuple[int, int, bool], ...]:
    """Maximal runs of same-kind layers as (first_layer, num_layers, is_moe); each is one scan.

    A run's layers share the FFN kind, the token mixer (`is_linear(first_layer)`), the
    sliding window (a sliding layer's decoding state is a ring of its window, a full layer's
    holds every position; MiMo's sliding layers also differ in shape) and, in DSA targets,
    whether they run their own indexer (`is_full_indexer(first_layer)`) and, in Gemma 4,
    whether they read another layer's K/V (`is_kv_shared(first_layer)`)."""
    runs: list[tuple[int, int, bool]] = []
    for i, moe in enumerate(self.layer_is_moe):
      if (
        runs
        and runs[-1][2] == moe
        and self.is_linear(runs[-1][0]) == self.is_linear(i)
        and self.layer_windows[runs[-1][0]] == self.layer_windows[i]
        and self._indexer_kind(runs[-1][0]) == self._indexer_kind(i)
        and self.is_kv_shared(runs[-1][0]) == self.is_kv_shared(i)
      ):
        start, n, _ = runs[-1]
        runs[-1] = (start, n + 1, moe)
      else:
        runs.append((i, 1, moe))
    return tuple(runs)

  def _indexer_kind(self, layer: int) -> str:
    return self.indexer_types[layer] if self.is_dsa else ""

  def replace(self, **changes: Any) -> "ModelConfig":
    """A copy with `changes` applied, validated.

    Changing `num_layers` without passing `layer_is_moe` re-derives `layer_is_moe` at the new
    depth from the rule this config keeps, exactly as `config_from_hf` would for the
    `config_to_hf` dict with the new `num_hidden_layers`:

    * `family.moe_rule` "first_k_dense" (Glm4Moe, DeepSeek, ...): `first_k_dense_replace` = the
      number of leading dense layers; layer i is MoE iff i >= it (so added layers are MoE,
      unless the model has no experts).
    * "sparse_step" (Qwen3-MoE, Qwen3-Next): layer i is MoE iff (i + 1) % `decoder_sparse_step` == 0 and i is not one of the
      dense layers at such positions (`mlp_only_layers`), so added layers follow the step.
    * No experts: every layer is dense.

    HF's rules are per layer index, so shrinking always keeps the first n entries. A layout that
    no rule describes (a Glm4Moe config whose MoE layers are not all after its dense ones) is
    truncated to its first n entries, or grown by repeating the last layer's kind. Passing
    `layer_is_moe` with `num_layers` uses it as given; it must have one entry per layer.
    """
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      hint = " (run options: with_options)" if set(unknown) & set(option_names()) else ""
      raise ConfigError(
        f"{self.architecture}: unknown ModelConfig field(s) {', '.join(unknown)}{hint}"
      )
    n = changes.get("num_layers")
    if is_int(n) and "layer_is_moe" not in changes:
      changes["layer_is_moe"] = self._layer_is_moe_at_depth(int(n))
    if is_int(n) and "layer_windows" not in changes:
      changes["layer_windows"] = self._windows_at_depth(int(n))
    if is_int(n) and "layer_types" not in changes:
      changes["layer_types"] = self._types_at_depth(int(n))
    if is_int(n) and "indexer_types" not in changes and self.indexer_types:
      old, m = self.indexer_types, int(n)
      changes["indexer_types"] = old[:m] + old[-1:] * max(0, m - len(old))
    return dataclasses.replace(self, **changes)

  def _types_at_depth(self, n: int) -> tuple[str, ...]:
    """`layer_types` for `n` layers: the full-attention-every-I-th-layer pattern (HF's
    `full_attention_interval`) when the config follows one, else the first n entries, grown by
    repeating the last layer's."""
    old = self.layer_types
    if n < 1:
      return old
    for interval in range(1, len(old) + 1):
      pattern = lambda m: tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(m)
      )
      if old == pattern(len(old)):
        return pattern(n)
    return old[:n] + old[-1:] * max(0, n - len(old))

  def _windows_at_depth(self, n: int) -> tuple[int, ...]:
    """`layer_windows` for `n` layers: gpt-oss's alternation (sliding at even layers) when the
    config follows it, else the first n entries, grown by repeating the last layer's."""
    old = self.layer_windows
    if n < 1:
      return old
    w = self.sliding_window
    if old == gpt_oss_windows(len(old), w):
      return gpt_oss_windows(n, w)
    return old[:n] + old[-1:] * max(0, n - len(old))

  def _layer_is_moe_at_depth(self, n: int) -> tuple[bool, ...]:
    """`layer_is_moe` for `n` layers under this config's rule (see `replace`)."""
    old = self.layer_is_moe
    if n < 1:
      return old  # validation reports the bad num_layers
    if not self.is_moe:
      return (False,) * n
    if self.family.moe_rule == "sparse_step" and self.decoder_sparse_step >= 1:
      step = self.decoder_sparse_step
      mlp_only = {i for i, moe in enumerate(old) if not moe}
      return tuple((i + 1) % step == 0 and i not in mlp_only for i in range(n))
    first_dense = old.index(True) if any(old) else len(old)
    if old == tuple(i >= first_dense for i in range(len(old))):
      return tuple(i >= first_dense for i in range(n))
    return old[:n] + old[-1:] * max(0, n - len(old))

  def validate(self) -> None:
    """Raises ConfigError naming the first field that jaxspec cannot run as given."""
    config_checks.validate(self)
