"""Frozen configuration dataclasses: what a model, a mesh and an engine are.

Configs are immutable and hashable so that they can be static arguments of jitted functions and
attributes of Flax modules. `ModelConfig.from_hf` reads a Hugging Face `config.json` dict for the
supported architectures and rejects anything it does not understand, rather than guessing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxspec.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM")


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
  router: str = "softmax"  # "softmax" (Qwen3-MoE) or "sigmoid" (GLM/DeepSeek, grouped, biased)
  norm_topk_prob: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  layer_is_moe: tuple[bool, ...] = ()
  decoder_sparse_step: int = 1  # Qwen3-MoE: only layers i with (i + 1) % step == 0 may be MoE
  moe_backend: str = "auto"  # "dense" (the oracle), "ragged", "gather" or "auto" (see moe.py)
  # Attention over the decoding state (models/attention.py): "xla" (chunked online softmax),
  # "pallas" (the tree-attention kernel) or "auto" (XLA until the kernel is checked on hardware);
  # the XLA path reads the committed prefix in chunks of `attention_chunk` slots.
  attention_impl: str = "auto"
  attention_chunk: int = 256
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
    """Maximal runs of same-kind layers as (first_layer, num_layers, is_moe); each is one scan."""
    runs: list[tuple[int, int, bool]] = []
    for i, moe in enumerate(self.layer_is_moe):
      if runs and runs[-1][2] == moe:
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
    if "num_layers" in changes and "layer_is_moe" not in changes:
      changes["layer_is_moe"] = self._layer_is_moe_at_depth(int(changes["num_layers"]))
    return dataclasses.replace(self, **changes)

  def _layer_is_moe_at_depth(self, n: int) -> tuple[bool, ...]:
    """`layer_is_moe` for `n` layers under this config's rule (see `replace`)."""
    old = self.layer_is_moe
    if n < 1:
      return old  # validation reports the bad num_layers
    if not self.is_moe:
      return (False,) * n
    if self.architecture == "Qwen3MoeForCausalLM" and self.decoder_sparse_step >= 1:
      step = self.decoder_sparse_step
      mlp_only = {i for i, moe in enumerate(old) if not moe}
      return tuple((i + 1) % step == 0 and i not in mlp_only for i in range(n))
    first_dense = old.index(True) if any(old) else len(old)
    if old == tuple(i >= first_dense for i in range(len(old))):
      return tuple(i >= first_dense for i in range(n))
    return old[:n] + old[-1:] * max(0, n - len(old))

  def validate(self) -> None:
    def need(cond: bool, msg: str) -> None:
      if not cond:
        raise ConfigError(f"{self.architecture}: {msg}")

    need(
      self.architecture in SUPPORTED_ARCHITECTURES,
      f"unsupported architecture; jaxspec supports {', '.join(SUPPORTED_ARCHITECTURES)}",
    )
    for name in (
      "vocab_size",
      "hidden_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    ):
      need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
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
        self.architecture == "Qwen3MoeForCausalLM",
        "decoder_sparse_step applies only to Qwen3MoeForCausalLM",
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
      self.moe_backend in ("auto", "dense", "ragged", "gather"),
      f"unknown moe_backend {self.moe_backend!r}",
    )
    need(
      self.attention_impl in ("auto", "xla", "pallas"),
      f"unknown attention_impl {self.attention_impl!r} (expected 'auto', 'xla' or 'pallas')",
    )
    need(self.attention_chunk >= 1, f"attention_chunk must be ≥ 1, got {self.attention_chunk}")
    need(self.dtype in ("float32", "bfloat16", "float16"), f"unsupported dtype {self.dtype!r}")
    if self.is_moe:
      need(
        0 < self.num_experts_per_tok <= self.num_experts,
        f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]",
      )
      need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
      need(self.router in ("softmax", "sigmoid"), f"unknown router {self.router!r}")
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
    """Builds a ModelConfig from a HF `config.json` dict; raises ConfigError on what it can't run."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
      raise ConfigError(
        f"unsupported architectures {archs!r} in config.json; jaxspec supports exactly one of "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
      )
    arch = archs[0]

    def get(key: str, default: Any = None) -> Any:
      return hf[key] if hf.get(key) is not None else default

    rope = dict(get("rope_parameters", None) or get("rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
      raise ConfigError(f"{arch}: RoPE type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    # Qwen3 rotates whole heads whatever the config says; GLM defaults to half (HF semantics).
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.5))

    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    num_layers = int(hf["num_hidden_layers"])
    if get("use_sliding_window", False) or any(
      t != "full_attention" for t in (get("layer_types", None) or [])
    ):
      raise ConfigError(f"{arch}: sliding-window attention layers are not supported")
    if get("hidden_act", "silu") != "silu":
      raise ConfigError(f"{arch}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")

    eos = get("eos_token_id", None)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    kw: dict[str, Any] = dict(
      architecture=arch,
      vocab_size=int(hf["vocab_size"]),
      hidden_size=hidden,
      num_layers=num_layers,
      num_heads=heads,
      num_kv_heads=int(get("num_key_value_heads", heads)),
      head_dim=int(get("head_dim", hidden // heads)),
      intermediate_size=int(get("intermediate_size", 0)),
      rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
      rope_theta=float(rope_theta),
      partial_rotary_factor=float(partial),
      attention_bias=bool(get("attention_bias", False)),
      tie_word_embeddings=bool(get("tie_word_embeddings", False)),
      max_position_embeddings=int(get("max_position_embeddings", 32768)),
      eos_token_ids=eos_ids,
      pad_token_id=get("pad_token_id", None),
      bos_token_id=get("bos_token_id", None),
    )
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
      kw.update(attention_out_bias=kw["attention_bias"], partial_rotary_factor=1.0)
    if arch == "Qwen3ForCausalLM":
      kw.update(qk_norm=True)
    elif arch == "Qwen3MoeForCausalLM":
      experts = int(get("num_experts", get("num_local_experts", 0)))
      sparse_step = int(get("decoder_sparse_step", 1))
      mlp_only = set(get("mlp_only_layers", []) or [])
      kw.update(
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=int(get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        router="softmax",
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        decoder_sparse_step=sparse_step if experts > 0 else 1,
        layer_is_moe=tuple(
          (i not in mlp_only) and experts > 0 and (i + 1) % sparse_step == 0
          for i in range(num_layers)
        ),
      )
    else:  # Glm4MoeForCausalLM
      first_dense = int(get("first_k_dense_replace", 1))
      kw.update(
        qk_norm=bool(get("use_qk_norm", False)),
        num_experts=int(get("n_routed_experts", get("num_local_experts", 0))),
        num_experts_per_tok=int(get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        router="sigmoid",
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        n_group=int(get("n_group", 1)),
        topk_group=int(get("topk_group", 1)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        n_shared_experts=int(get("n_shared_experts", 0)),
        layer_is_moe=tuple(i >= first_dense for i in range(num_layers)),
      )
    kw["num_mtp_layers"] = int(get("num_nextn_predict_layers", get("num_mtp_layers", 0)))
    kw.update(overrides)
    return cls(**kw)

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
    if self.num_mtp_layers and self.architecture != "Glm4MoeForCausalLM":
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
