"""Frozen configuration dataclasses: what a model, a mesh and an engine are.

Configs are immutable and hashable so that they can be static arguments of jitted functions and
attributes of Flax modules. `ModelConfig.from_hf` reads a Hugging Face `config.json` dict for the
supported architectures and rejects anything it does not understand, rather than guessing.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence

from jaxspec.errors import ConfigError

SUPPORTED_ARCHITECTURES = (
  "Qwen3ForCausalLM",
  "Qwen3MoeForCausalLM",
  "Glm4MoeForCausalLM",
  "GptOssForCausalLM",
  "Qwen3NextForCausalLM",
  "Qwen3_5ForCausalLM",
  "Qwen3_5MoeForCausalLM",
)
# Hybrid targets: Gated DeltaNet (linear-attention) layers beside gated full-attention layers,
# zero-centred RMSNorms ((1 + w) · x) and a sigmoid-gated shared expert (models/gated_deltanet.py).
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# Published Qwen3.5 checkpoints are vision-language models: the text model of each, read from
# its nested `text_config` (and `model.language_model.*` tensors: jaxspec/io/hf.py).
MULTIMODAL_TEXT_ARCHITECTURES = {
  "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
  "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


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


LAYER_TYPES = ("full_attention", "linear_attention")
# gpt-oss's RoPE when config.json states none (transformers' GptOssConfig default).
GPT_OSS_DEFAULT_ROPE = {
  "rope_type": "yarn",
  "factor": 32.0,
  "beta_fast": 32.0,
  "beta_slow": 1.0,
  "truncate": False,
  "original_max_position_embeddings": 4096,
}

# ModelConfig fields → the config.json key users see, for messages about values read from it.
_HF_NAMES = {
  "num_layers": "num_hidden_layers",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "num_mtp_layers": "num_nextn_predict_layers",
}
_REQUIRED = object()


def _is_int(v: Any) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _show(v: Any) -> str:
  text = repr(v)
  return text if len(text) <= 60 else text[:57] + "..."


class HFConfigReader:
  """Typed reads of one HF `config.json` dict: every bad field is a ConfigError naming it.

  A field that is absent or null takes its default (HF's convention for optional fields); with
  no default it is required, and `require` names every missing one at once. Integers must be
  JSON integers (not booleans, not 64.0), floats finite numbers, booleans JSON booleans, so
  that nothing is silently truncated or coerced (`bool("false")` is True). `what` prefixes the
  messages (the architecture or drafter kind).
  """

  def __init__(self, hf: Mapping[str, Any], what: str):
    if not isinstance(hf, Mapping):
      raise ConfigError(f"{what}: config.json must hold a JSON object, got {type(hf).__name__}")
    self.hf = hf
    self.what = what
    self._rope_sources: list[tuple[str, Mapping[str, Any]]] = []  # set by `rope`

  def error(self, msg: str) -> ConfigError:
    return ConfigError(f"{self.what}: {msg}")

  def has(self, key: str) -> bool:
    return self.hf.get(key) is not None

  def require(self, *keys: str) -> None:
    """Raises ConfigError naming the keys that are absent or null."""
    absent = [k for k in keys if k not in self.hf]
    null = [k for k in keys if k in self.hf and self.hf[k] is None]
    parts = []
    if absent:
      parts.append(f"missing required field(s): {', '.join(absent)}")
    if null:
      parts.append(f"null required field(s): {', '.join(f'{k}=null' for k in null)}")
    if parts:
      raise self.error("; ".join(parts))

  def _value(self, key: str, default: Any) -> Any:
    if self.hf.get(key) is not None:
      return self.hf[key]
    if default is _REQUIRED:
      self.require(key)
    return default

  def integer(self, key: str, default: Any = _REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not _is_int(v):
      raise self.error(f"{key} must be an integer, got {_show(v)}")
    return int(v)

  def first_integer(self, keys: Sequence[str], default: Any = _REQUIRED) -> Any:
    """The integer under the first of `keys` that is set (HF's aliases, e.g. num_experts)."""
    for key in keys:
      if self.has(key):
        return self.integer(key)
    return self.integer(keys[0], default)

  def number(self, key: str, default: Any = _REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not _is_real(v) or not math.isfinite(v):
      raise self.error(f"{key} must be a finite number, got {_show(v)}")
    return float(v)

  def flag(self, key: str, default: Any = _REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, bool):
      raise self.error(f"{key} must be true or false, got {_show(v)}")
    return v

  def string(self, key: str, default: Any = _REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, str):
      raise self.error(f"{key} must be a string, got {_show(v)}")
    return v

  def integers(self, key: str, default: Any = _REQUIRED, scalar_ok: bool = False) -> Any:
    """A list of integers as a tuple (with `scalar_ok`, a lone integer too, as eos_token_id)."""
    v = self._value(key, default)
    if v is default:
      return v
    if scalar_ok and _is_int(v):
      return (int(v),)
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
      kind = "an integer or a list of integers" if scalar_ok else "a list of integers"
      raise self.error(f"{key} must be {kind}, got {_show(v)}")
    return tuple(int(x) for x in v)

  def strings(self, key: str, default: Any = _REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
      raise self.error(f"{key} must be a list of strings, got {_show(v)}")
    return tuple(v)

  def mapping(self, key: str) -> dict:
    """The JSON object under `key` as a dict ({} when absent or null)."""
    v = self._value(key, None)
    if v is None:
      return {}
    if not isinstance(v, Mapping):
      raise self.error(f"{key} must be a JSON object, got {_show(v)}")
    return dict(v)

  def rope(
    self,
    default_theta: float = 10000.0,
    default_partial: float | None = None,
    allowed: tuple[str, ...] = ("default",),
  ) -> tuple[float, float | None]:
    """(rope_theta, partial_rotary_factor) of a config that must use the default RoPE.

    transformers reads RoPE from `rope_parameters` (v5), the legacy `rope_scaling` (which it
    prefers when both are set) and the top-level `rope_theta` / `partial_rotary_factor` (used
    where the dict lacks them); a dict may also be nested per layer type. jaxspec implements
    only the default RoPE, so any other type in any of these places raises, naming it; and a
    setting given twice with different values raises too, since whichever a reader picks, the
    other was meant. `default_partial` None means the architecture ignores the factor (Qwen3),
    so it is neither read nor checked and None is returned.
    """
    sources: list[tuple[str, Mapping[str, Any]]] = []
    for key in ("rope_parameters", "rope_scaling"):
      d = self.mapping(key)
      nested = {k: v for k, v in d.items() if isinstance(v, Mapping)}
      if nested and len(nested) != len(d):
        raise self.error(f"{key} mixes per-layer-type entries {sorted(nested)} with flat ones")
      if nested:
        sources += [(f"{key}.{k}", v) for k, v in nested.items()]
      elif d:
        sources.append((key, d))
    self._rope_sources = sources
    for label, d in sources:
      rope_type = d.get("rope_type") or d.get("type") or "default"
      if rope_type not in allowed:
        raise self.error(
          f"RoPE type {_show(rope_type)} in {label} is not supported "
          f"({', '.join(repr(a) for a in allowed)})"
        )

    def setting(name: str, default: float) -> float:
      found = [(f"{label}.{name}", d[name]) for label, d in sources if d.get(name) is not None]
      if self.has(name):
        found.append((name, self.hf[name]))
      for label, v in found:
        if not _is_real(v) or not math.isfinite(v):
          raise self.error(f"{label} must be a finite number, got {_show(v)}")
      if len({float(v) for _, v in found}) > 1:
        raise self.error(f"conflicting {name}: {', '.join(f'{label}={v}' for label, v in found)}")
      return float(found[0][1]) if found else default

    theta = setting("rope_theta", default_theta)
    if not theta > 0:
      raise self.error(f"rope_theta must be positive, got {theta}")
    if default_partial is None:
      return theta, None
    partial = setting("partial_rotary_factor", default_partial)
    if not 0 < partial <= 1:
      raise self.error(f"partial_rotary_factor must be in (0, 1], got {partial}")
    return theta, partial

  def rope_scaling(self, max_position_embeddings: int) -> tuple[tuple[str, Any], ...]:
    """The RoPE scaling settings (after `rope`), normalized: () for the default RoPE, else
    sorted (name, value) pairs of "linear" (factor) or "yarn" (factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale,
    mscale_all_dim, truncate), with transformers' defaults filled in. Every place the config
    states a scaling must state the same one."""
    found = {}
    for label, d in self._rope_sources:
      rope_type = d.get("rope_type") or d.get("type") or "default"
      if rope_type == "default":
        continue
      found[label] = self._normalized_scaling(label, rope_type, d, max_position_embeddings)
    if len(set(found.values())) > 1:
      raise self.error(f"conflicting RoPE scaling: {found}")
    return next(iter(found.values()), ())

  def _normalized_scaling(
    self, label: str, rope_type: str, d: Mapping[str, Any], max_position_embeddings: int
  ) -> tuple[tuple[str, Any], ...]:
    def number(name: str, default: Any, positive: bool = True) -> Any:
      v = d.get(name)
      if v is None:
        return default
      if not _is_real(v) or not math.isfinite(v) or (positive and not v > 0):
        raise self.error(f"{label}.{name} must be a finite positive number, got {_show(v)}")
      return float(v)

    if rope_type in ("linear", "dynamic"):
      factor = number("factor", None)
      if factor is None:
        raise self.error(f"{label}: {rope_type} RoPE scaling needs a factor")
      if rope_type == "linear":
        return (("factor", factor), ("rope_type", "linear"))
      # Dynamic NTK: the base for the whole extended context, max_position_embeddings × factor.
      length = int(max_position_embeddings)
      return (("factor", factor), ("max_position_embeddings", length), ("rope_type", "dynamic"))
    original = d.get("original_max_position_embeddings")
    if not _is_int(original) or original < 1:
      raise self.error(
        f"{label}: yarn RoPE scaling needs original_max_position_embeddings, got {_show(original)}"
      )
    factor = number("factor", None)
    if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
      factor = max_position_embeddings / original
    truncate = d.get("truncate", True)
    if not isinstance(truncate, bool):
      raise self.error(f"{label}.truncate must be a bool, got {_show(truncate)}")
    return tuple(
      sorted(
        {
          "rope_type": "yarn",
          "factor": factor,
          "original_max_position_embeddings": int(original),
          "beta_fast": number("beta_fast", 32.0),
          "beta_slow": number("beta_slow", 1.0),
          "attention_factor": number("attention_factor", None),
          "mscale": number("mscale", None, positive=False),
          "mscale_all_dim": number("mscale_all_dim", None, positive=False),
          "truncate": truncate,
        }.items()
      )
    )


def gpt_oss_windows(num_layers: int, window: int) -> tuple[int, ...]:
  """gpt-oss's default layer pattern: sliding-window attention at even layers, full at odd."""
  return tuple(window if i % 2 == 0 else 0 for i in range(num_layers))


# RoPE variants jaxspec computes (layers.rope_frequencies).
ROPE_TYPES = ("default", "linear", "yarn", "dynamic")
MOE_BACKENDS = ("auto", "dense", "ragged", "gather", "loop", "ep", "ep_replicate", "ep_all_to_all")


def _hybrid_fields(r: HFConfigReader, arch: str, num_layers: int) -> dict[str, Any]:
  """The Qwen3-Next / Qwen3.5 fields of a config.json (transformers' defaults when absent)."""
  types = r.strings("layer_types", None)
  if types is None:
    interval = r.integer("full_attention_interval", 4)
    if interval < 1:
      raise r.error(f"full_attention_interval must be positive, got {interval}")
    types = tuple(
      "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
    )
  if len(types) != num_layers or set(types) - set(LAYER_TYPES):
    raise r.error(
      f"layer_types must name 'linear_attention' or 'full_attention' for each of the "
      f"{num_layers} layers, got {_show(list(types))}"
    )
  kw: dict[str, Any] = dict(
    layer_types=tuple(types),
    linear_conv_kernel_dim=r.integer("linear_conv_kernel_dim", 4),
    linear_key_head_dim=r.integer("linear_key_head_dim", 128),
    linear_value_head_dim=r.integer("linear_value_head_dim", 128),
    linear_num_key_heads=r.integer("linear_num_key_heads", 16),
    linear_num_value_heads=r.integer("linear_num_value_heads", 32),
  )
  # Qwen3.5 / Qwen3-Next checkpoints store one MTP module (`mtp.*`) of `mtp_num_hidden_layers`
  # decoder layers, applied once per draft: jaxspec builds it as one MTP layer.
  mtp = r.integer("mtp_num_hidden_layers", 0)
  if mtp not in (0, 1):
    raise r.error(f"mtp_num_hidden_layers={mtp}: an MTP module of several layers is not supported")
  if mtp and r.flag("mtp_use_dedicated_embeddings", False):
    raise r.error(
      "mtp_use_dedicated_embeddings: an MTP module with its own embedding is not supported"
    )
  kw["num_mtp_layers"] = mtp
  if arch == "Qwen3_5ForCausalLM":
    return kw
  experts = r.integer("num_experts", 512)
  moe_arch = arch == "Qwen3_5MoeForCausalLM"
  if moe_arch and experts < 1:
    raise r.error(f"num_experts must be positive, got {experts}")
  step = 1 if moe_arch else r.integer("decoder_sparse_step", 1)
  if experts > 0 and step < 1:
    raise r.error(f"decoder_sparse_step must be positive, got {step}")
  mlp_only = set() if moe_arch else set(r.integers("mlp_only_layers", ()))
  kw.update(
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 8 if moe_arch else 10),
    moe_intermediate_size=r.integer("moe_intermediate_size", 512),
    shared_expert_intermediate_size=r.integer("shared_expert_intermediate_size", 512)
    if experts > 0
    else 0,
    router="softmax",
    norm_topk_prob=True if moe_arch else r.flag("norm_topk_prob", True),
    decoder_sparse_step=step if experts > 0 else 1,
    layer_is_moe=tuple(
      (i not in mlp_only) and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    ),
  )
  return kw


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
  # RoPE scaling, normalized by HFConfigReader.rope_scaling: () = none, else sorted (name,
  # value) pairs of "linear" or "yarn" (models/layers.py: rope_frequencies).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  partial_rotary_factor: float = 1.0
  attention_bias: bool = False  # biases on q/k/v projections
  attention_out_bias: bool = False  # bias on o_proj (Qwen3 ties it to attention_bias; GLM never)
  qk_norm: bool = True
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  # Mixture of experts (num_experts == 0 means dense).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  # "softmax" (Qwen3-MoE), "sigmoid" (GLM/DeepSeek: grouped, bias-corrected choice) or
  # "topk_softmax" (gpt-oss: biased logits, top-k, softmax over the k chosen).
  router: str = "softmax"
  norm_topk_prob: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  layer_is_moe: tuple[bool, ...] = ()
  decoder_sparse_step: int = 1  # Qwen3-MoE: only layers i with (i + 1) % step == 0 may be MoE
  # "dense" (the oracle), "ragged", "gather", "loop", "auto", or expert-parallel on a mesh "ep",
  # "ep_replicate", "ep_all_to_all" (see moe.py and expert_parallel.py).
  moe_backend: str = "auto"
  # Expert-parallel all_to_all buffers: 0 = exact (no pair ever dropped), f > 0 = rows for f times
  # the mean load per destination, later pairs dropped (models/expert_parallel.py).
  ep_capacity_factor: float = 0.0
  # Grouped matmul of the ragged backend over MXFP4 expert weights: "xla" (dequantize, then
  # ragged_dot), "pallas" (pallas_kernels/mxfp4_gmm, dequantized tile by tile) or "auto" (XLA
  # until the kernel has run on hardware).
  gmm_impl: str = "auto"
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
  # Attention over the decoding state (models/attention.py): "xla" (chunked online softmax),
  # "pallas" (the tree-attention kernel) or "auto" (XLA until the kernel is checked on hardware);
  # the XLA path reads the committed prefix in chunks of `attention_chunk` slots.
  attention_impl: str = "auto"
  attention_chunk: int = 256
  # Hybrid targets (HYBRID_ARCHITECTURES): each layer's token mixer, "full_attention" or
  # "linear_attention" (Gated DeltaNet; empty: all full), and the linear layers' shapes.
  layer_types: tuple[str, ...] = ()
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  # Chunk of the chunked delta rule (prefill, long blocks) and how many per-position states a
  # linear layer's decoding state keeps for a block (the widest block chain verification may
  # commit a prefix of; models/gated_deltanet.py, state.LinearState).
  linear_chunk: int = 64
  # The chunked rule of the linear layers' prefill / long blocks: "xla" (`lax.scan` over chunks),
  # "pallas" (pallas_kernels/gated_delta) or "auto" (XLA until the kernel has run on hardware).
  linear_attention_impl: str = "auto"
  linear_snapshots: int = 16
  # Qwen3-Next / Qwen3.5-MoE shared expert: one SwiGLU of this width, gated by
  # sigmoid(x · w_gate) (0: none).
  shared_expert_intermediate_size: int = 0
  # Layer runs as one `nn.scan` over stacked parameters [n, ...] (True: compile time flat in
  # depth; training's layout), or unrolled over per-layer parameter buffers (False: decoding's
  # layout, since a scanned layer's weights are sliced out of the stack, a copy on backends
  # that cannot feed a matmul from a slice; see docs/benchmarks.md). Convert with
  # `TargetModel.with_scan_layers`.
  scan_layers: bool = True
  # Multi-token-prediction layers stored after the main layers (DeepSeek-V3 layout).
  num_mtp_layers: int = 0
  # Special tokens.
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  # Numerics: dtype of activations/matmuls; parameters are stored in `param_dtype`.
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    self._check_types()  # before layer_is_moe is derived from num_layers and the sparse step
    if not self.layer_types:
      object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
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
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def fused_gate_up(self) -> bool:
    """Experts hold gate and up as one interleaved [E, H, 2I] weight (gpt-oss's layout)."""
    return self.architecture == "GptOssForCausalLM"

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
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def shared_intermediate_size(self) -> int:
    return self.moe_intermediate_size * self.n_shared_experts

  @property
  def mtp_is_moe(self) -> bool:
    """MTP blocks use routed experts whenever the model has them (HF and DeepSeek convention)."""
    return self.is_moe

  def segments(self) -> tuple[tuple[int, int, bool], ...]:
    """Maximal runs of same-kind layers as (first_layer, num_layers, is_moe); each is one scan.

    A run's layers share the FFN kind and the token mixer (`is_linear(first_layer)`)."""
    runs: list[tuple[int, int, bool]] = []
    for i, moe in enumerate(self.layer_is_moe):
      if runs and runs[-1][2] == moe and self.is_linear(runs[-1][0]) == self.is_linear(i):
        start, n, _ = runs[-1]
        runs[-1] = (start, n + 1, moe)
      else:
        runs.append((i, 1, moe))
    return tuple(runs)

  def replace(self, **changes: Any) -> "ModelConfig":
    """A copy with `changes` applied, validated.

    Changing `num_layers` without passing `layer_is_moe` re-derives `layer_is_moe` at the new
    depth from the rule this config keeps, exactly as `from_hf` would for the `to_hf` dict with
    the new `num_hidden_layers`:

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
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise ConfigError(f"{self.architecture}: unknown ModelConfig field(s) {', '.join(unknown)}")
    n = changes.get("num_layers")
    if _is_int(n) and "layer_is_moe" not in changes:
      changes["layer_is_moe"] = self._layer_is_moe_at_depth(int(n))
    if _is_int(n) and "layer_windows" not in changes:
      changes["layer_windows"] = self._windows_at_depth(int(n))
    if _is_int(n) and "layer_types" not in changes:
      changes["layer_types"] = self._types_at_depth(int(n))
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
    "attention_chunk",
    "linear_conv_kernel_dim",
    "linear_chunk",
    "linear_snapshots",
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
  )
  _POSITIVE_FLOATS = (
    "swiglu_alpha",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "routed_scaling_factor",
  )
  _BOOLS = (
    "scan_layers",
    "attention_bias",
    "attention_out_bias",
    "qk_norm",
    "tie_word_embeddings",
    "norm_topk_prob",
    "expert_bias",
    "attention_sinks",
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
    for name in self._POSITIVE_INTS + self._COUNTS:
      v = getattr(self, name)
      need(_is_int(v), f"{self._name(name)} must be an integer, got {_show(v)}")
    for name in self._POSITIVE_FLOATS:
      v = getattr(self, name)
      need(_is_real(v) and math.isfinite(v), f"{name} must be a finite number, got {_show(v)}")
    for name in self._BOOLS:
      v = getattr(self, name)
      need(isinstance(v, bool), f"{name} must be True or False, got {_show(v)}")
    for name in ("pad_token_id", "bos_token_id"):
      v = getattr(self, name)
      need(v is None or _is_int(v), f"{name} must be an integer or None, got {_show(v)}")
    need(
      isinstance(self.eos_token_ids, tuple) and all(_is_int(t) for t in self.eos_token_ids),
      f"eos_token_ids must be a tuple of integers, got {_show(self.eos_token_ids)}",
    )
    need(
      isinstance(self.layer_is_moe, (tuple, list)),
      f"layer_is_moe must be a tuple of booleans, got {_show(self.layer_is_moe)}",
    )
    need(
      _is_real(self.swiglu_limit) and math.isfinite(self.swiglu_limit) and self.swiglu_limit >= 0,
      f"swiglu_limit must be a finite number ≥ 0, got {_show(self.swiglu_limit)}",
    )
    need(
      isinstance(self.layer_types, (tuple, list))
      and all(t in LAYER_TYPES for t in self.layer_types),
      f"layer_types must name {' or '.join(LAYER_TYPES)} per layer, got {_show(self.layer_types)}",
    )
    need(
      isinstance(self.layer_windows, (tuple, list))
      and all(_is_int(w) and w >= 0 for w in self.layer_windows),
      f"layer_windows must be a tuple of integers ≥ 0, got {_show(self.layer_windows)}",
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
      self.moe_backend in MOE_BACKENDS,
      f"unknown moe_backend {self.moe_backend!r}; expected one of {MOE_BACKENDS}",
    )
    need(
      not isinstance(self.ep_capacity_factor, bool)
      and isinstance(self.ep_capacity_factor, (int, float))
      and math.isfinite(self.ep_capacity_factor)
      and self.ep_capacity_factor >= 0,
      f"ep_capacity_factor must be a finite number >= 0 (0: exact), got {self.ep_capacity_factor!r}",
    )
    need(
      self.gmm_impl in ("auto", "xla", "pallas"),
      f"unknown gmm_impl {self.gmm_impl!r} (expected 'auto', 'xla' or 'pallas')",
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
    gpt_oss = self.architecture == "GptOssForCausalLM"
    need(
      gpt_oss or not (self.attention_sinks or self.sliding_window),
      "attention sinks and sliding windows are gpt-oss features (GptOssForCausalLM)",
    )
    need(
      gpt_oss or not (self.expert_bias or self.swiglu_limit or self.router == "topk_softmax"),
      "biased experts, the clamped SwiGLU and the top-k-softmax router are gpt-oss features",
    )
    need(
      self.attention_impl != "pallas" or not (self.attention_sinks or self.sliding_window),
      "the Pallas attention kernel has no sinks or sliding windows; use attention_impl='xla'",
    )
    need(
      self.attention_impl in ("auto", "xla", "pallas"),
      f"unknown attention_impl {self.attention_impl!r} (expected 'auto', 'xla' or 'pallas')",
    )
    need(
      self.linear_attention_impl in ("auto", "xla", "pallas"),
      f"unknown linear_attention_impl {self.linear_attention_impl!r} "
      "(expected 'auto', 'xla' or 'pallas')",
    )
    need(self.attention_chunk >= 1, f"attention_chunk must be ≥ 1, got {self.attention_chunk}")
    scaling = dict(self.rope_scaling) if isinstance(self.rope_scaling, tuple) else {}
    need(
      isinstance(self.rope_scaling, tuple)
      and (not self.rope_scaling or scaling.get("rope_type") in ROPE_TYPES[1:]),
      f"rope_scaling must be () or normalized (name, value) pairs of a {ROPE_TYPES[1:]} "
      f"scaling, got {_show(self.rope_scaling)}",
    )
    for name in ("dtype", "param_dtype"):
      v = getattr(self, name)
      need(
        v in ("float32", "bfloat16", "float16"),
        f"unsupported {name} {_show(v)} (expected 'float32', 'bfloat16' or 'float16')",
      )
    if self.is_moe:
      need(
        0 < self.num_experts_per_tok <= self.num_experts,
        f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]",
      )
      need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
      need(self.router in ("softmax", "sigmoid", "topk_softmax"), f"unknown router {self.router!r}")
      need(self.num_experts % self.n_group == 0, "n_routed_experts must divide into n_group groups")
      need(1 <= self.topk_group <= self.n_group, "topk_group must be in [1, n_group]")
      if self.router == "sigmoid" and self.n_group > 1:
        need(
          self.num_experts // self.n_group >= 2,
          "grouped routing scores each group by its top-2 experts: need ≥ 2 experts per group",
        )
    else:
      need(not any(self.layer_is_moe), "layer_is_moe set on a model without experts")

  # ----------------------------------------------------------------------------------------------
  # Hugging Face config.json
  # ----------------------------------------------------------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
    """Builds a ModelConfig from a HF `config.json` dict; raises ConfigError on what it can't run.

    Every field is type-checked as it is read (see `HFConfigReader`): vocab_size, hidden_size,
    num_hidden_layers, num_attention_heads and intermediate_size are required, the rest default
    as in transformers when absent or null. RoPE is the default, linear or YaRN type
    (`ROPE_TYPES`), stated consistently wherever the config states it (`HFConfigReader.rope`,
    `rope_scaling`). `overrides` are
    ModelConfig fields applied last; the result is validated as a whole.
    """
    if not isinstance(hf, Mapping):
      raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    hf = text_config(hf)
    archs = hf.get("architectures") or []
    if (
      not isinstance(archs, (list, tuple))
      or len(archs) != 1
      or archs[0] not in SUPPORTED_ARCHITECTURES
    ):
      raise ConfigError(
        f"unsupported architectures {_show(archs)} in config.json; jaxspec supports exactly one "
        f"of {', '.join(SUPPORTED_ARCHITECTURES)}"
      )
    arch = archs[0]
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ConfigError(f"{arch}: unknown ModelConfig field(s) {', '.join(unknown)} in overrides")
    r = HFConfigReader(hf, arch)
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    if arch != "Qwen3_5MoeForCausalLM":  # all of its layers are MoE: no dense width
      required.append("intermediate_size")
    r.require(*required)
    gpt_oss = arch == "GptOssForCausalLM"
    hybrid = arch in HYBRID_ARCHITECTURES
    sliding = r.flag("use_sliding_window", False) or any(
      t != "full_attention" for t in r.strings("layer_types", ())
    )
    if sliding and not (gpt_oss or hybrid):
      raise r.error("sliding-window attention layers are not supported")
    if r.string("hidden_act", "silu") != "silu":
      raise r.error(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    qwen = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if gpt_oss and not (r.mapping("rope_parameters") or r.mapping("rope_scaling")):
      r = HFConfigReader({**hf, "rope_parameters": GPT_OSS_DEFAULT_ROPE}, arch)
    # Qwen3 and gpt-oss rotate whole heads whatever the config says; GLM defaults to half.
    if hybrid:  # transformers' default RoPE over the first quarter of each head
      rope_theta, partial = r.rope(10000.0, 0.25, allowed=("default",))
    else:
      rope_theta, partial = r.rope(
        150000.0 if gpt_oss else 10000.0, None if qwen or gpt_oss else 0.5, allowed=ROPE_TYPES
      )

    hidden = r.integer("hidden_size")
    heads = r.integer("num_attention_heads")
    num_layers = r.integer("num_hidden_layers")
    kw: dict[str, Any] = dict(
      architecture=arch,
      vocab_size=r.integer("vocab_size"),
      hidden_size=hidden,
      num_layers=num_layers,
      num_heads=heads,
      num_kv_heads=r.integer("num_key_value_heads", heads),
      head_dim=r.integer("head_dim", 256 if hybrid else hidden // heads if heads > 0 else 0),
      intermediate_size=r.integer(
        "intermediate_size", 0 if arch == "Qwen3_5MoeForCausalLM" else _REQUIRED
      ),
      rms_norm_eps=r.number("rms_norm_eps", 1e-6),
      rope_theta=rope_theta,
      rope_scaling=r.rope_scaling(r.integer("max_position_embeddings", 32768)),
      partial_rotary_factor=1.0 if qwen or gpt_oss else partial,
      attention_bias=r.flag("attention_bias", gpt_oss),
      tie_word_embeddings=r.flag("tie_word_embeddings", False),
      max_position_embeddings=r.integer("max_position_embeddings", 32768),
      eos_token_ids=r.integers("eos_token_id", (), scalar_ok=True),
      pad_token_id=r.integer("pad_token_id", None),
      bos_token_id=r.integer("bos_token_id", None),
      num_mtp_layers=r.first_integer(("num_nextn_predict_layers", "num_mtp_layers"), 0),
    )
    if qwen or hybrid:
      kw.update(attention_out_bias=kw["attention_bias"], qk_norm=True)
    if hybrid:
      kw.update(_hybrid_fields(r, arch, num_layers))
    if arch == "Qwen3MoeForCausalLM":
      experts = r.first_integer(("num_experts", "num_local_experts"), 0)
      sparse_step = r.integer("decoder_sparse_step", 1)
      if experts > 0 and sparse_step < 1:
        raise r.error(f"decoder_sparse_step must be positive, got {sparse_step}")
      mlp_only = set(r.integers("mlp_only_layers", ()))
      kw.update(
        num_experts=experts,
        num_experts_per_tok=r.integer("num_experts_per_tok", 0),
        moe_intermediate_size=r.integer("moe_intermediate_size", 0),
        router="softmax",
        norm_topk_prob=r.flag("norm_topk_prob", False),
        decoder_sparse_step=sparse_step if experts > 0 else 1,
        layer_is_moe=tuple(
          (i not in mlp_only) and experts > 0 and (i + 1) % sparse_step == 0
          for i in range(num_layers)
        ),
      )
    elif gpt_oss:
      stated_null = "sliding_window" in hf and hf["sliding_window"] is None  # no window
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
          f"{num_layers} layers, got {_show(list(types))}"
        )
      experts = r.first_integer(("num_local_experts", "num_experts"), 0)
      if experts < 1:
        raise r.error(f"num_local_experts must be positive, got {experts}")
      kw.update(
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
    elif arch == "Glm4MoeForCausalLM":
      first_dense = r.integer("first_k_dense_replace", 1)
      if first_dense < 0:
        raise r.error(f"first_k_dense_replace must be ≥ 0, got {first_dense}")
      kw.update(
        qk_norm=r.flag("use_qk_norm", False),
        num_experts=r.first_integer(("n_routed_experts", "num_local_experts"), 0),
        num_experts_per_tok=r.integer("num_experts_per_tok", 0),
        moe_intermediate_size=r.integer("moe_intermediate_size", 0),
        router="sigmoid",
        norm_topk_prob=r.flag("norm_topk_prob", True),
        n_group=r.integer("n_group", 1),
        topk_group=r.integer("topk_group", 1),
        routed_scaling_factor=r.number("routed_scaling_factor", 1.0),
        n_shared_experts=r.integer("n_shared_experts", 0),
        layer_is_moe=tuple(i >= first_dense for i in range(num_layers)),
      )
    kw.update(overrides)
    return cls(**kw)

  def _hybrid_hf(self) -> dict[str, Any]:
    """The Qwen3-Next / Qwen3.5 part of `to_hf`."""
    hf: dict[str, Any] = dict(
      model_type={
        "Qwen3NextForCausalLM": "qwen3_next",
        "Qwen3_5ForCausalLM": "qwen3_5_text",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
      }[self.architecture],
      layer_types=list(self.layer_types),
      linear_conv_kernel_dim=self.linear_conv_kernel_dim,
      linear_key_head_dim=self.linear_key_head_dim,
      linear_value_head_dim=self.linear_value_head_dim,
      linear_num_key_heads=self.linear_num_key_heads,
      linear_num_value_heads=self.linear_num_value_heads,
    )
    if self.architecture == "Qwen3_5ForCausalLM":
      return hf
    hf.update(
      num_experts=self.num_experts,
      num_experts_per_tok=self.num_experts_per_tok,
      moe_intermediate_size=self.moe_intermediate_size,
      shared_expert_intermediate_size=self.shared_expert_intermediate_size,
    )
    if self.architecture == "Qwen3NextForCausalLM":
      step = self.decoder_sparse_step
      hf.update(
        norm_topk_prob=self.norm_topk_prob,
        decoder_sparse_step=step,
        mlp_only_layers=[
          i for i, m in enumerate(self.layer_is_moe) if not m and (i + 1) % step == 0
        ],
      )
    return hf

  def to_hf(self) -> dict[str, Any]:
    """The HF `config.json` dict that describes this architecture (inverse of from_hf)."""
    hf: dict[str, Any] = dict(
      architectures=[self.architecture],
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      num_hidden_layers=self.num_layers,
      num_attention_heads=self.num_heads,
      num_key_value_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      intermediate_size=self.intermediate_size,
      rms_norm_eps=self.rms_norm_eps,
      hidden_act="silu",
      attention_bias=self.attention_bias,
      tie_word_embeddings=self.tie_word_embeddings,
      max_position_embeddings=self.max_position_embeddings,
      rope_parameters={
        "rope_type": "default",
        # (dynamic's length is the config's own max_position_embeddings, written below)
        **{k: v for k, v in self.rope_scaling if v is not None and k != "max_position_embeddings"},
        "rope_theta": self.rope_theta,
        "partial_rotary_factor": self.partial_rotary_factor,
      },
      rope_theta=self.rope_theta,
      partial_rotary_factor=self.partial_rotary_factor,
      torch_dtype=self.param_dtype,
    )
    if self.eos_token_ids:
      hf["eos_token_id"] = (
        self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
      )
    if self.pad_token_id is not None:
      hf["pad_token_id"] = self.pad_token_id
    if self.bos_token_id is not None:
      hf["bos_token_id"] = self.bos_token_id
    if self.architecture == "Qwen3ForCausalLM":
      hf["model_type"] = "qwen3"
    elif self.architecture == "GptOssForCausalLM":
      window = self.sliding_window
      hf.update(
        model_type="gpt_oss",
        intermediate_size=self.moe_intermediate_size,
        num_local_experts=self.num_experts,
        num_experts_per_tok=self.num_experts_per_tok,
        swiglu_limit=self.swiglu_limit,
        swiglu_alpha=self.swiglu_alpha,
        sliding_window=window or None,
        layer_types=["sliding_attention" if w else "full_attention" for w in self.layer_windows],
      )
      if len(set(w for w in self.layer_windows if w)) > 1:
        raise ConfigError(f"gpt-oss has one sliding window size, got {set(self.layer_windows)}")
    elif self.is_hybrid:
      hf.update(self._hybrid_hf())
      if self.architecture == "Qwen3_5MoeForCausalLM":  # every layer is MoE: no dense width
        hf.pop("intermediate_size")
    elif self.architecture == "Qwen3MoeForCausalLM":
      step = self.decoder_sparse_step
      hf.update(
        model_type="qwen3_moe",
        num_experts=self.num_experts,
        num_experts_per_tok=self.num_experts_per_tok,
        moe_intermediate_size=self.moe_intermediate_size,
        norm_topk_prob=self.norm_topk_prob,
        decoder_sparse_step=step,
        mlp_only_layers=[
          i for i, m in enumerate(self.layer_is_moe) if not m and (i + 1) % step == 0
        ],
      )
    else:
      first_dense = self.layer_is_moe.index(True) if any(self.layer_is_moe) else self.num_layers
      if self.layer_is_moe != tuple(i >= first_dense for i in range(self.num_layers)):
        raise ConfigError("Glm4Moe layout needs dense layers first, then MoE layers")
      hf.update(
        model_type="glm4_moe",
        use_qk_norm=self.qk_norm,
        n_routed_experts=self.num_experts,
        num_experts_per_tok=self.num_experts_per_tok,
        moe_intermediate_size=self.moe_intermediate_size,
        norm_topk_prob=self.norm_topk_prob,
        n_group=self.n_group,
        topk_group=self.topk_group,
        routed_scaling_factor=self.routed_scaling_factor,
        n_shared_experts=self.n_shared_experts,
        first_k_dense_replace=first_dense,
        num_nextn_predict_layers=self.num_mtp_layers,
      )
    if self.num_mtp_layers and self.is_hybrid:
      hf["mtp_num_hidden_layers"] = self.num_mtp_layers
    elif self.num_mtp_layers and self.architecture != "Glm4MoeForCausalLM":
      hf["num_nextn_predict_layers"] = self.num_mtp_layers
    return hf


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
