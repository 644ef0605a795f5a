"""Frozen configuration dataclasses: what a model and a mesh are.

Configs are immutable and hashable so that they can be static arguments of jitted functions and
attributes of Flax modules. Reading and writing a Hugging Face `config.json` is the io layer's
job (jaxspec.io.architectures: one small mapping per architecture family); this module only says
what a valid architecture is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Mapping

from jaxspec.errors import ConfigError, is_int, is_real, show
from jaxspec.options import RunOptions, option_names

SUPPORTED_ARCHITECTURES = (
  "Qwen3ForCausalLM",
  "Qwen3MoeForCausalLM",
  "Glm4MoeForCausalLM",
  "GptOssForCausalLM",
  "Qwen3NextForCausalLM",
  "Qwen3_5ForCausalLM",
  "Qwen3_5MoeForCausalLM",
  "DeepseekV3ForCausalLM",
  "DeepseekV32ForCausalLM",
  "GlmMoeDsaForCausalLM",
  "MiniMaxM2ForCausalLM",
  "MiMoV2FlashForCausalLM",
  "Gemma4ForCausalLM",
)
# Architectures with sliding-window layers and attention sinks (gpt-oss; MiMo-V2-Flash's SWA
# layers, which also differ from its full layers in KV heads and RoPE base; Gemma 4's, whose
# full layers differ in head width, KV heads and RoPE).
WINDOWED_ARCHITECTURES = ("GptOssForCausalLM", "MiMoV2FlashForCausalLM", "Gemma4ForCausalLM")
# Gemma 4's text model: sandwich norms, scaled embeddings, q/k/v norms with unit attention
# scale, per-layer input embeddings, KV-shared layers, logit soft-capping (models/decoder.py).
GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM",)
# Activations of the dense MLP: SwiGLU's silu, or GeGLU's tanh-approximated GELU (Gemma).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
QK_NORM_TYPES = ("per_head", "per_layer")
# Hybrid targets: Gated DeltaNet (linear-attention) layers beside gated full-attention layers,
# zero-centred RMSNorms ((1 + w) · x) and a sigmoid-gated shared expert (models/gated_deltanet.py).
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
LAYER_TYPES = ("full_attention", "linear_attention")
# Multi-head Latent Attention targets (models/mla.py); the last two add DeepSeek Sparse Attention's
# lightning indexer (models/dsa.py).
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
INDEXER_TYPES = ("full", "shared")

# ModelConfig fields → the config.json key users see, for messages about values read from it.
_HF_NAMES = {
  "num_layers": "num_hidden_layers",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "num_mtp_layers": "num_nextn_predict_layers",
}


# The config.json mapping, registered by jaxspec.io.architectures when it is imported (always, by
# `import jaxspec`): the deprecated ModelConfig.from_hf / to_hf call it without this bottom layer
# importing the io layer above it.
_HF_MAPPING: dict[str, Callable[..., Any]] = {}


def register_hf_mapping(from_hf: Callable[..., Any], to_hf: Callable[..., Any]) -> None:
  """Installs the functions the deprecated `ModelConfig.from_hf` / `to_hf` delegate to."""
  _HF_MAPPING.update(from_hf=from_hf, to_hf=to_hf)


def _deprecated(old: str, new: str) -> None:
  warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)
  if not _HF_MAPPING:  # only when jaxspec.config was loaded without the jaxspec package
    raise ConfigError(f"{old} is deprecated and its mapping is not loaded: use {new}")


def _options_with(options: RunOptions, moved: dict[str, Any], where: str) -> RunOptions:
  """`options` with the run-option fields `moved` (passed the old way, as ModelConfig fields)
  applied, after a DeprecationWarning that names the new way."""
  names = ", ".join(f"{k}=..." for k in moved)
  warnings.warn(
    f"{where}({names}) is deprecated: run options live in ModelConfig.options; pass "
    f"options=jaxspec.RunOptions({names}), or use config.with_options({names}) or "
    f"TargetModel.with_options({names})",
    DeprecationWarning,
    stacklevel=3,
  )
  return options.replace(**moved)


def gpt_oss_windows(num_layers: int, window: int) -> tuple[int, ...]:
  """gpt-oss's default layer pattern: sliding-window attention at even layers, full at odd."""
  return tuple(window if i % 2 == 0 else 0 for i in range(num_layers))


# RoPE variants jaxspec computes (layers.rope_frequencies).
ROPE_TYPES = ("default", "linear", "yarn", "dynamic")
# Gemma 4's full layers: "proportional" RoPE turns the first partial_rotary_factor of each
# head's frequency pairs (exponents over the whole head width) and leaves the rest unturned.
GEMMA4_ROPE_TYPES = ("proportional",)


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
  # sorted (name, value) pairs of "linear" or "yarn" (models/layers.py: rope_frequencies).
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
  # Hybrid targets (HYBRID_ARCHITECTURES): each layer's token mixer, "full_attention" or
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
  # Multi-head Latent Attention (MLA_ARCHITECTURES; kv_lora_rank 0: not MLA). Keys and values
  # come from a per-token latent of kv_lora_rank values plus one shared RoPE key of
  # qk_rope_head_dim; head_dim is qk_nope_head_dim + qk_rope_head_dim, values have v_head_dim.
  q_lora_rank: int = 0  # 0: a plain q_proj, else q_a_proj → q_a_layernorm → q_b_proj
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False  # RoPE on interleaved feature pairs (DeepSeek's layout)
  # DeepSeek Sparse Attention (DSA_ARCHITECTURES): the lightning indexer picks each query's
  # index_topk keys; "shared" layers reuse the previous "full" layer's choice (index_n_heads 0:
  # dense attention).
  index_n_heads: int = 0
  index_head_dim: int = 0
  index_topk: int = 0
  indexer_types: tuple[str, ...] = ()
  indexer_rope_interleave: bool = False  # GLM-5: interleaved; DeepSeek-V3.2: half-split
  # Gemma 4 (GEMMA4_ARCHITECTURES). Full-attention layers' own head width and KV heads (0:
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
  # The dense MLP's activation (HIDDEN_ACTS).
  hidden_act: str = "silu"
  # Special tokens.
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  # How jaxspec runs the model (kernels, chunks, layout, dtypes): not part of the architecture,
  # never read from or written to config.json (jaxspec/options.py).
  options: RunOptions = RunOptions()

  def __getattr__(self, name: str) -> Any:
    """Deprecated reads of the run options as ModelConfig fields (`config.scan_layers`)."""
    if name in _OPTION_NAMES:
      warnings.warn(
        f"ModelConfig.{name} is deprecated; read config.options.{name}",
        DeprecationWarning,
        stacklevel=2,
      )
      return getattr(self.options, name)
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def __post_init__(self):
    self._check_types()  # before layer_is_moe is derived from num_layers and the sparse step
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
  def fused_gate_up(self) -> bool:
    """Experts hold gate and up as one [E, H, 2I] weight: interleaved (gpt-oss), or gate then
    up (Gemma 4)."""
    return self.architecture == "GptOssForCausalLM" or self.is_gemma4

  @property
  def is_hybrid(self) -> bool:
    """Qwen3-Next / Qwen3.5: zero-centred norms, gated attention output, maybe linear layers."""
    return self.architecture in HYBRID_ARCHITECTURES

  @property
  def norm_offset(self) -> float:
    """RMSNorm weights are stored as w with scale 1 + w (zero-centred) in hybrid targets."""
    return 1.0 if self.is_hybrid else 0.0

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
  def is_gemma4(self) -> bool:
    return self.architecture in GEMMA4_ARCHITECTURES

  @property
  def embedding_scale(self) -> float:
    """The factor on token embeddings as they enter the model (Gemma: sqrt(hidden_size));
    drafters that embed tokens with the target's table apply it too."""
    return self.hidden_size**0.5 if self.is_gemma4 else 1.0

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
    if self.is_gemma4:
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
    set the scale."""
    if self.is_gemma4:
      return 1.0
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
    return self.architecture == "MiMoV2FlashForCausalLM"

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

    * Glm4Moe: `first_k_dense_replace` = the number of leading dense layers; layer i is MoE iff
      i >= it (so added layers are MoE, unless the model has no experts).
    * Qwen3-MoE: layer i is MoE iff (i + 1) % `decoder_sparse_step` == 0 and i is not one of the
      dense layers at such positions (`mlp_only_layers`), so added layers follow the step.
    * No experts: every layer is dense.

    HF's rules are per layer index, so shrinking always keeps the first n entries. A layout that
    no rule describes (a Glm4Moe config whose MoE layers are not all after its dense ones) is
    truncated to its first n entries, or grown by repeating the last layer's kind. Passing
    `layer_is_moe` with `num_layers` uses it as given; it must have one entry per layer.
    """
    moved = {k: changes.pop(k) for k in option_names() if k in changes}  # field order
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise ConfigError(f"{self.architecture}: unknown ModelConfig field(s) {', '.join(unknown)}")
    if moved:
      options = changes.get("options", self.options)
      try:
        changes["options"] = _options_with(options, moved, "ModelConfig.replace")
      except ConfigError as e:
        raise ConfigError(f"{self.architecture}: {e}") from None
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
    sparse_step_archs = ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
    if self.architecture in sparse_step_archs and self.decoder_sparse_step >= 1:
      step = self.decoder_sparse_step
      mlp_only = {i for i, moe in enumerate(old) if not moe}
      return tuple((i + 1) % step == 0 and i not in mlp_only for i in range(n))
    first_dense = old.index(True) if any(old) else len(old)
    if old == tuple(i >= first_dense for i in range(len(old))):
      return tuple(i >= first_dense for i in range(n))
    return old[:n] + old[-1:] * max(0, n - len(old))

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
  )

  def _need(self, cond: bool, msg: str) -> None:
    if not cond:
      raise ConfigError(f"{self.architecture}: {msg}")

  def _name(self, field: str) -> str:
    """`field`, with its config.json name when that differs (messages reach HF users)."""
    hf = _HF_NAMES.get(field)
    return f"{field} ({hf})" if hf else field

  def _check_types(self) -> None:
    """Every numeric field a real int / finite float / bool: no bools, NaNs or 64.5 sizes."""
    need = self._need
    need(
      isinstance(self.options, RunOptions),
      f"options must be a jaxspec.RunOptions, got {show(self.options)}",
    )
    for name in self._POSITIVE_INTS + self._COUNTS:
      v = getattr(self, name)
      need(is_int(v), f"{self._name(name)} must be an integer, got {show(v)}")
    for name in self._POSITIVE_FLOATS:
      v = getattr(self, name)
      need(is_real(v) and math.isfinite(v), f"{name} must be a finite number, got {show(v)}")
    for name in self._BOOLS:
      v = getattr(self, name)
      need(isinstance(v, bool), f"{name} must be True or False, got {show(v)}")
    for name in ("pad_token_id", "bos_token_id"):
      v = getattr(self, name)
      need(v is None or is_int(v), f"{name} must be an integer or None, got {show(v)}")
    need(
      isinstance(self.eos_token_ids, tuple) and all(is_int(t) for t in self.eos_token_ids),
      f"eos_token_ids must be a tuple of integers, got {show(self.eos_token_ids)}",
    )
    need(
      isinstance(self.layer_is_moe, (tuple, list)),
      f"layer_is_moe must be a tuple of booleans, got {show(self.layer_is_moe)}",
    )
    need(
      is_real(self.swiglu_limit) and math.isfinite(self.swiglu_limit) and self.swiglu_limit >= 0,
      f"swiglu_limit must be a finite number ≥ 0, got {show(self.swiglu_limit)}",
    )
    need(
      isinstance(self.layer_types, (tuple, list))
      and all(t in LAYER_TYPES for t in self.layer_types),
      f"layer_types must name {' or '.join(LAYER_TYPES)} per layer, got {show(self.layer_types)}",
    )
    need(
      isinstance(self.layer_windows, (tuple, list))
      and all(is_int(w) and w >= 0 for w in self.layer_windows),
      f"layer_windows must be a tuple of integers ≥ 0, got {show(self.layer_windows)}",
    )

  def validate(self) -> None:
    """Raises ConfigError naming the first field that jaxspec cannot run as given."""
    self._check_types()
    need = self._need
    need(
      self.architecture in SUPPORTED_ARCHITECTURES,
      f"unsupported architecture; jaxspec supports {', '.join(SUPPORTED_ARCHITECTURES)}",
    )
    for name in self._POSITIVE_INTS:
      v = getattr(self, name)
      need(v > 0, f"{self._name(name)} must be positive, got {v}")
    for name in self._COUNTS:
      v = getattr(self, name)
      need(v >= 0, f"{self._name(name)} must be ≥ 0, got {v}")
    for name in self._POSITIVE_FLOATS:
      v = getattr(self, name)
      need(v > 0, f"{name} must be positive, got {v}")
    need(
      self.partial_rotary_factor <= 1,
      f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}",
    )
    need(
      all(t >= 0 for t in self.eos_token_ids),
      f"eos token ids must be ≥ 0, got {list(self.eos_token_ids)}",
    )
    dense_mlp = not all(self.layer_is_moe) or (self.num_mtp_layers and not self.mtp_is_moe)
    need(
      self.intermediate_size > 0 or not dense_mlp,
      f"intermediate_size must be positive for the dense MLP layers, got {self.intermediate_size}",
    )
    need(
      self.num_heads % self.num_kv_heads == 0,
      f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
      f"({self.num_kv_heads})",
    )
    need(
      self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
      f"rotary dim {self.rotary_dim} (head_dim × partial_rotary_factor) must be even and in "
      f"(0, head_dim]",
    )
    need(
      len(self.layer_is_moe) == self.num_layers,
      f"layer_is_moe has {len(self.layer_is_moe)} entries but num_layers is {self.num_layers}: "
      f"it needs one entry per layer",
    )
    need(
      self.decoder_sparse_step >= 1,
      f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}",
    )
    if self.decoder_sparse_step > 1:
      need(
        self.architecture in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"),
        "decoder_sparse_step applies only to Qwen3MoeForCausalLM and Qwen3NextForCausalLM",
      )
      off_step = [
        i for i, moe in enumerate(self.layer_is_moe) if moe and (i + 1) % self.decoder_sparse_step
      ]
      need(
        not off_step,
        f"layers {off_step} are MoE but decoder_sparse_step={self.decoder_sparse_step} allows "
        f"experts only in layers i with (i + 1) % step == 0",
      )
    need(
      len(self.layer_windows) == self.num_layers,
      f"layer_windows has {len(self.layer_windows)} entries but num_layers is "
      f"{self.num_layers}: it needs one entry per layer",
    )
    need(
      len(self.layer_types) == self.num_layers,
      f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}: "
      f"it needs one entry per layer",
    )
    if any(t == "linear_attention" for t in self.layer_types):
      need(self.is_hybrid, f"linear_attention layers need one of {HYBRID_ARCHITECTURES}")
      for name in (
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
      ):
        need(getattr(self, name) > 0, f"{name} must be positive for linear_attention layers")
      need(
        self.linear_num_value_heads % self.linear_num_key_heads == 0,
        f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
        f"linear_num_key_heads ({self.linear_num_key_heads})",
      )
      need(
        self.linear_conv_kernel_dim >= 2,
        f"linear_conv_kernel_dim must be ≥ 2, got {self.linear_conv_kernel_dim}",
      )
    need(
      not self.shared_expert_intermediate_size or self.is_hybrid,
      "a gated shared expert (shared_expert_intermediate_size) is a Qwen3-Next / Qwen3.5 feature",
    )
    self._validate_mla()
    gpt_oss = self.architecture == "GptOssForCausalLM"
    windowed = self.architecture in WINDOWED_ARCHITECTURES
    sliding_only = (
      self.sliding_attention_sinks,
      self.sliding_num_kv_heads,
      self.sliding_rope_theta,
    )
    need(
      windowed or not (self.attention_sinks or self.sliding_window or any(sliding_only)),
      f"attention sinks and sliding windows are features of {', '.join(WINDOWED_ARCHITECTURES)}",
    )
    need(
      is_real(self.sliding_rope_theta) and self.sliding_rope_theta >= 0,
      f"sliding_rope_theta must be ≥ 0 (0: rope_theta), got {show(self.sliding_rope_theta)}",
    )
    need(
      self.qk_norm_type in QK_NORM_TYPES,
      f"qk_norm_type must be one of {QK_NORM_TYPES}, got {show(self.qk_norm_type)}",
    )
    kv_sliding = self.sliding_num_kv_heads or self.num_kv_heads
    need(
      self.num_heads % kv_sliding == 0,
      f"num_attention_heads ({self.num_heads}) must be a multiple of the sliding layers' KV "
      f"heads ({kv_sliding})",
    )
    need(
      gpt_oss or not (self.expert_bias or self.swiglu_limit or self.router == "topk_softmax"),
      "biased experts, the clamped SwiGLU and the top-k-softmax router are gpt-oss features",
    )
    need(
      self.options.attention_impl != "pallas"
      or not (self.attention_sinks or self.sliding_attention_sinks or self.sliding_window),
      "the Pallas attention kernel has no sinks or sliding windows; use attention_impl='xla'",
    )
    self._validate_gemma4()
    scaling = dict(self.rope_scaling) if isinstance(self.rope_scaling, tuple) else {}
    rope_types = ROPE_TYPES[1:] + (GEMMA4_ROPE_TYPES if self.is_gemma4 else ())
    need(
      isinstance(self.rope_scaling, tuple)
      and (not self.rope_scaling or scaling.get("rope_type") in rope_types),
      f"rope_scaling must be () or normalized (name, value) pairs of a {ROPE_TYPES[1:]} "
      f"scaling, got {show(self.rope_scaling)}",
    )
    if self.is_moe:
      need(
        0 < self.num_experts_per_tok <= self.num_experts,
        f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]",
      )
      need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
      routers = ("softmax", "sigmoid", "topk_softmax", "gemma4")
      need(self.router in routers, f"unknown router {self.router!r}")
      need(
        (self.router == "gemma4") == self.is_gemma4,
        "the gemma4 router (scaled RMS-normed input, per-expert scales) is Gemma 4's, and "
        "Gemma 4's MoE block uses it",
      )
      need(self.num_experts % self.n_group == 0, "n_routed_experts must divide into n_group groups")
      need(1 <= self.topk_group <= self.n_group, "topk_group must be in [1, n_group]")
      if self.router == "sigmoid" and self.n_group > 1:
        need(
          self.num_experts // self.n_group >= 2,
          "grouped routing scores each group by its top-2 experts: need ≥ 2 experts per group",
        )
    else:
      need(not any(self.layer_is_moe), "layer_is_moe set on a model without experts")

  def _validate_gemma4(self) -> None:
    """Gemma 4's fields: only in Gemma 4, and consistent."""
    need = self._need
    need(
      self.hidden_act in HIDDEN_ACTS,
      f"hidden_act must be one of {HIDDEN_ACTS}, got {show(self.hidden_act)}",
    )
    need(
      is_real(self.final_logit_softcapping) and self.final_logit_softcapping >= 0,
      f"final_logit_softcapping must be ≥ 0 (0: none), got {show(self.final_logit_softcapping)}",
    )
    gemma_only = (
      self.global_head_dim,
      self.global_num_kv_heads,
      self.attention_k_eq_v,
      self.num_kv_shared_layers,
      self.hidden_size_per_layer_input,
      self.final_logit_softcapping,
      self.use_double_wide_mlp,
    )
    need(
      self.is_gemma4 or not any(gemma_only),
      "global head widths, KV-shared layers, per-layer inputs and logit soft-capping are "
      f"features of {', '.join(GEMMA4_ARCHITECTURES)}",
    )
    if not self.is_gemma4:
      return
    need(
      all(self.layer_is_moe) or not any(self.layer_is_moe),
      "the Gemma 4 MoE block is in every layer or in none (enable_moe_block)",
    )
    need(
      self.num_kv_shared_layers < self.num_layers,
      f"num_kv_shared_layers ({self.num_kv_shared_layers}) must leave a layer that computes "
      f"K/V (num_hidden_layers {self.num_layers})",
    )
    if self.num_kv_shared_layers:
      first = self.num_layers - self.num_kv_shared_layers
      kinds = {self.is_sliding(i) for i in range(first)}
      shared = {self.is_sliding(i) for i in range(first, self.num_layers)}
      need(
        shared <= kinds,
        "KV-shared layers of a type (sliding or full) no earlier layer has: nothing to share",
      )
    need(
      self.num_heads % self.attention_kv_heads(False) == 0,
      f"num_attention_heads ({self.num_heads}) must be a multiple of the full layers' KV "
      f"heads ({self.attention_kv_heads(False)})",
    )
    need(
      not self.hidden_size_per_layer_input or self.vocab_size_per_layer_input > 0,
      "per-layer inputs need vocab_size_per_layer_input > 0",
    )

  def _validate_mla(self) -> None:
    """MLA and DSA fields: present exactly where the architecture has them, and consistent."""
    need = self._need
    mla = self.architecture in MLA_ARCHITECTURES
    need(mla == self.is_mla, f"kv_lora_rank > 0 (MLA) goes with exactly {MLA_ARCHITECTURES}")
    if not mla:
      need(
        not (self.q_lora_rank or self.is_dsa or self.rope_interleave),
        "q_lora_rank, rope_interleave and the DSA indexer are MLA features",
      )
      return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      need(getattr(self, name) > 0, f"{name} must be positive for MLA")
    need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
    need(
      self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim,
      f"head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
      f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim}) for MLA",
    )
    need(
      self.num_kv_heads == self.num_heads,
      f"MLA expands the latent to every head: num_key_value_heads ({self.num_kv_heads}) must be "
      f"num_attention_heads ({self.num_heads})",
    )
    need(
      self.options.attention_impl != "pallas",
      "the Pallas attention kernel does not read MLA's latent cache; use attention_impl='xla'",
    )
    dsa = self.architecture in DSA_ARCHITECTURES
    need(dsa == self.is_dsa, f"the DSA indexer (index_n_heads > 0) goes with exactly {DSA_ARCHITECTURES}")
    if not dsa:
      return
    need(self.q_lora_rank > 0, "the DSA indexer reads the q low-rank latent: q_lora_rank must be > 0")
    need(self.index_head_dim > 0, "index_head_dim must be positive")
    need(
      self.qk_rope_head_dim <= self.index_head_dim,
      f"index_head_dim ({self.index_head_dim}) must hold the RoPE part ({self.qk_rope_head_dim})",
    )
    need(self.index_topk > 0, "index_topk must be positive")
    need(
      isinstance(self.indexer_types, tuple)
      and len(self.indexer_types) == self.num_layers
      and all(t in INDEXER_TYPES for t in self.indexer_types),
      f"indexer_types must name {' or '.join(INDEXER_TYPES)} for each of the {self.num_layers} "
      f"layers, got {show(self.indexer_types)}",
    )
    need(
      self.indexer_types[0] == "full",
      "the first layer's indexer must be 'full': a 'shared' layer reuses an earlier choice",
    )

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json: jaxspec.io.architectures (deprecated here)
  # ----------------------------------------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
    """Deprecated: `jaxspec.io.architectures.config_from_hf(hf, **overrides)`."""
    _deprecated("ModelConfig.from_hf", "jaxspec.io.architectures.config_from_hf")
    return _HF_MAPPING["from_hf"](hf, **overrides)

  def to_hf(self) -> dict[str, Any]:
    """Deprecated: `jaxspec.io.architectures.config_to_hf(config)`."""
    _deprecated("ModelConfig.to_hf", "jaxspec.io.architectures.config_to_hf")
    return _HF_MAPPING["to_hf"](self)


_OPTION_NAMES = frozenset(option_names())


def _accept_option_fields(init: Callable[..., None]) -> Callable[..., None]:
  """ModelConfig's generated __init__, still accepting the run options as fields (deprecated):
  `ModelConfig(..., attention_impl="xla")` goes into `options`, after a DeprecationWarning."""

  @functools.wraps(init)
  def __init__(self, *args: Any, **kwargs: Any) -> None:
    moved = {k: kwargs.pop(k) for k in option_names() if k in kwargs}  # field order
    if moved:
      try:
        kwargs["options"] = _options_with(kwargs.get("options", RunOptions()), moved, "ModelConfig")
      except ConfigError as e:
        arch = kwargs.get("architecture", args[0] if args else "ModelConfig")
        raise ConfigError(f"{arch}: {e}") from None
    init(self, *args, **kwargs)

  return __init__


ModelConfig.__init__ = _accept_option_fields(ModelConfig.__init__)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape and the logical-axis → mesh-axis rules (empty rules = the defaults)."""

  data: int = 1
  expert: int = 1
  tensor: int = 1
  rules: tuple[tuple[str, Any], ...] = ()

  @property
  def shape(self) -> dict[str, int]:
    return {"data": self.data, "expert": self.expert, "tensor": self.tensor}
