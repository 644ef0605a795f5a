"""What every architecture's config.json shares, and the record each family registers.

An `Architecture` names one HF `architectures` entry, its family's mechanisms (`Family`: what
model code branches on) and the few facts that make the shared config.json fields differ between
families (RoPE defaults, whether a dense MLP width is stated, whether sliding layers are
allowed); its `read` and `write` add the family's own fields. The shared part is read and
written here, once, so that a new family (DeepSeek-V3, MiniMax, Gemma, ...) is one
small module in this package plus a line in its table (`__init__.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxspec.config import ModelConfig
from jaxspec.config_checks import ROPE_TYPES
from jaxspec.family import Family
from jaxspec.io.architectures.reader import REQUIRED, HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout

# Family fields read from config.json: (reader, the shared fields read so far) -> fields to add.
Reader = Callable[[HFConfigReader, dict[str, Any]], dict[str, Any]]
# Family keys written to config.json: the config -> keys to add to (or replace in) the shared ones.
Writer = Callable[[ModelConfig], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One HF architecture name and how its config.json maps onto `ModelConfig`.

  Attributes:
    name: the `architectures` entry (and `ModelConfig.architecture`).
    family: the mechanisms the family brings (jaxspec.family; the default: none beyond a
      plain pre-norm decoder), registered under `name` by this package's `__init__`.
    model_type: config.json's `model_type`.
    read: the family's fields (MoE, windows, linear layers, ...), after the shared ones.
    write: the family's config.json keys, after the shared ones.
    dense_width: whether `intermediate_size` (a dense MLP's width) is required and written.
    sliding: whether layers other than full attention (`layer_types`, `use_sliding_window`)
      are allowed.
    rope_theta: the RoPE base when config.json states none.
    rotary_fraction: the default `partial_rotary_factor`; None: the family rotates whole
      heads whatever config.json says (the factor is neither read nor checked).
    rope_types: the RoPE types accepted (`HFConfigReader.rope`).
    default_rope: the RoPE parameters assumed when config.json states none (gpt-oss's YaRN).
    head_dim: `head_dim` when absent (None: hidden_size // num_attention_heads).
    attention_bias: `attention_bias` when absent.
    mtp_key: the config.json key that states the number of MTP layers, when there are any.
    tensors: the family's checkpoint tensor names where they differ from Llama / Qwen's.
    attention_layer_types: the `layer_types` entries that mean (non-sliding) attention layers
      of this family (DSA targets write "indexed_attention").
    prepare: config.json → the dict the shared and family readers read, for families whose
      published configs spell shared facts their own way (MiMo's per-type RoPE, hub keys).
  """

  name: str
  model_type: str
  read: Reader
  write: Writer
  family: Family = Family()
  dense_width: bool = True
  sliding: bool = False
  rope_theta: float = 10000.0
  rotary_fraction: float | None = 0.5
  rope_types: tuple[str, ...] = ROPE_TYPES
  default_rope: Mapping[str, Any] | None = None
  head_dim: int | None = None
  attention_bias: bool = False
  mtp_key: str = "num_nextn_predict_layers"
  tensors: TensorLayout = TensorLayout()
  attention_layer_types: tuple[str, ...] = ("full_attention",)
  prepare: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


def read_shared(r: HFConfigReader, arch: Architecture) -> tuple[HFConfigReader, dict[str, Any]]:
  """The fields every architecture states, checked; returns the reader to go on with (one
  that sees `arch.default_rope` when config.json states no RoPE) and the fields."""
  required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
  if arch.dense_width:
    required.append("intermediate_size")
  r.require(*required)
  other = sorted({t for t in r.strings("layer_types", ()) if t not in arch.attention_layer_types})
  if not arch.sliding and (r.flag("use_sliding_window", False) or other):
    stated = f"layer_types {other}" if other else "use_sliding_window=true"
    raise r.error(f"sliding-window attention layers ({stated}) are not supported")
  if r.string("hidden_act", "silu") != "silu":
    raise r.error(f"hidden_act {r.hf['hidden_act']!r} is not supported (only 'silu')")
  if arch.default_rope and not (r.mapping("rope_parameters") or r.mapping("rope_scaling")):
    r = HFConfigReader({**r.hf, "rope_parameters": dict(arch.default_rope)}, r.what)
  rope_theta, partial = r.rope(arch.rope_theta, arch.rotary_fraction, allowed=arch.rope_types)
  hidden = r.integer("hidden_size")
  heads = r.integer("num_attention_heads")
  num_layers = r.integer("num_hidden_layers")
  head_dim = arch.head_dim if arch.head_dim is not None else hidden // heads if heads > 0 else 0
  return r, dict(
    architecture=arch.name,
    vocab_size=r.integer("vocab_size"),
    hidden_size=hidden,
    num_layers=num_layers,
    num_heads=heads,
    num_kv_heads=r.integer("num_key_value_heads", heads),
    head_dim=r.integer("head_dim", head_dim),
    intermediate_size=r.integer("intermediate_size", REQUIRED if arch.dense_width else 0),
    rms_norm_eps=r.number("rms_norm_eps", 1e-6),
    rope_theta=rope_theta,
    rope_scaling=r.rope_scaling(r.integer("max_position_embeddings", 32768)),
    partial_rotary_factor=1.0 if partial is None else partial,
    attention_bias=r.flag("attention_bias", arch.attention_bias),
    tie_word_embeddings=r.flag("tie_word_embeddings", False),
    max_position_embeddings=r.integer("max_position_embeddings", 32768),
    eos_token_ids=r.integers("eos_token_id", (), scalar_ok=True),
    pad_token_id=r.integer("pad_token_id", None),
    bos_token_id=r.integer("bos_token_id", None),
    num_mtp_layers=r.first_integer(("num_nextn_predict_layers", "num_mtp_layers"), 0),
    # jaxspec's own keys, written when an MTP layer keeps its own embedding / head (hf.py)
    mtp_own_embed=r.flag("mtp_own_embed", False),
    mtp_own_head=r.flag("mtp_own_head", False),
  )


def write_shared(config: ModelConfig, arch: Architecture) -> dict[str, Any]:
  """The config.json keys every architecture writes (the inverse of `read_shared`)."""
  c = config
  hf: dict[str, Any] = dict(
    architectures=[c.architecture],
    vocab_size=c.vocab_size,
    hidden_size=c.hidden_size,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    intermediate_size=c.intermediate_size,
    rms_norm_eps=c.rms_norm_eps,
    hidden_act="silu",
    attention_bias=c.attention_bias,
    tie_word_embeddings=c.tie_word_embeddings,
    max_position_embeddings=c.max_position_embeddings,
    rope_parameters={
      "rope_type": "default",
      # (dynamic's length is the config's own max_position_embeddings, written above)
      **{k: v for k, v in c.rope_scaling if v is not None and k != "max_position_embeddings"},
      "rope_theta": c.rope_theta,
      "partial_rotary_factor": c.partial_rotary_factor,
    },
    rope_theta=c.rope_theta,
    partial_rotary_factor=c.partial_rotary_factor,
    # The dtype the weights are kept in (a run option, written so that transformers loads them
    # as such; reading config.json never sets it).
    torch_dtype=c.options.param_dtype,
    model_type=arch.model_type,
  )
  if not arch.dense_width:
    hf.pop("intermediate_size")
  if c.eos_token_ids:
    hf["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
  if c.pad_token_id is not None:
    hf["pad_token_id"] = c.pad_token_id
  if c.bos_token_id is not None:
    hf["bos_token_id"] = c.bos_token_id
  if c.num_mtp_layers:
    hf[arch.mtp_key] = c.num_mtp_layers
  for key in ("mtp_own_embed", "mtp_own_head"):
    if getattr(c, key):
      hf[key] = True
  return hf

