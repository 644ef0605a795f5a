"""GGUF files (llama.cpp's format) read as a Hugging Face checkpoint: config, tensors, tokenizer.

A `.gguf` holds what a HF directory spreads over config.json, the safetensors shards and
tokenizer.json, under llama.cpp's names. `GGUFCheckpoint` maps each onto the HF form the rest
of jaxspec reads: the metadata becomes a config.json dict (`hf_config`) of the architecture's
HF class, the tensors appear under their HF names with HF shapes (`tensor_source`, a drop-in
for `safetensors_files.TensorSource`), dequantized to float32 as they are read, and
`tokenizer.ggml.*` becomes a `tokenizers` tokenizer (`jaxspec.io.gguf_tokenizer`). Loading then
goes through the HF path unchanged (`jaxspec.io.hf.load_model`).

What the converter (llama.cpp's convert_hf_to_gguf.py) changed is undone here:
* GGUF lists a tensor's dimensions innermost first: the numpy array of its rows is HF's layout.
* `llama`: the q/k projections' rows are permuted per head (each head's halves interleaved, for
  llama.cpp's RoPE kernel): un-permuted, so that HF's rotate-half RoPE applies.
* `gemma3`: RMSNorm weights are stored as 1 + w (llama.cpp's plain RMSNorm): 1 is taken off.
* `qwen3moe`: the experts are stored stacked ([E, out, in]): each HF expert is one slice.
* Llama 3's "llama3" RoPE scaling is stored as per-frequency divisors (`rope_freqs.weight`):
  read back as the rope_scaling that gives exactly those divisors, else refused.

The file itself is parsed and dequantized by `jaxspec.io.gguf_file`: F32, F16, BF16, Q8_0,
Q4_0 and Q4_1 in numpy, the K-quants (Q4_K, Q5_K, Q6_K) and other ggml types with the optional
gguf package (`pip install gguf`, or `jaxspec[gguf]`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any
from collections.abc import Callable

import numpy as np

from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.io import gguf_file, gguf_tokenizer

SUFFIX = ".gguf"

# HF name → llama.cpp name: the whole-model tensors, and each layer's (under `blk.{i}.`).
GLOBAL_NAMES = {
  "model.embed_tokens.weight": "token_embd.weight",
  "model.norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
  "input_layernorm.weight": "attn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "self_attn.q_proj.bias": "attn_q.bias",
  "self_attn.k_proj.bias": "attn_k.bias",
  "self_attn.v_proj.bias": "attn_v.bias",
  "self_attn.q_norm.weight": "attn_q_norm.weight",
  "self_attn.k_norm.weight": "attn_k_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
  "mlp.gate.weight": "ffn_gate_inp.weight",
}
# Gemma 3's sandwich norms: llama.cpp's ffn_norm is the pre-feedforward norm there.
SANDWICH_LAYER_NAMES = {
  **LAYER_NAMES,
  "post_attention_layernorm.weight": "post_attention_norm.weight",
  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
  "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Stacked experts ([E, out, in]): llama.cpp name → the HF per-expert projection.
EXPERT_NAMES = {
  "ffn_gate_exps.weight": "gate_proj",
  "ffn_up_exps.weight": "up_proj",
  "ffn_down_exps.weight": "down_proj",
}
# Tensors read into the config, not the weights: Llama 3's RoPE frequency divisors.
ROPE_FREQS = "rope_freqs.weight"
DERIVED = frozenset({ROPE_FREQS})
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: str) -> bool:
  """Whether `path` names a GGUF file (by its suffix; the file is checked when opened)."""
  return isinstance(path, str) and path.lower().endswith(SUFFIX)


# --------------------------------------------------------------------------------------------------
# Metadata → config.json
# --------------------------------------------------------------------------------------------------


def _llama_extra(meta: Metadata) -> dict[str, Any]:
  return dict(attention_bias=False, mlp_bias=False)


def _qwen2_extra(meta: Metadata) -> dict[str, Any]:
  return dict(use_sliding_window=False)


def _qwen3_extra(meta: Metadata) -> dict[str, Any]:
  return dict(attention_bias=meta.has_tensor("blk.0.attn_q.bias"))


def _qwen3moe_extra(meta: Metadata) -> dict[str, Any]:
  # llama.cpp's qwen3moe graph puts experts in every layer and renormalizes the top-k weights.
  return dict(
    _qwen3_extra(meta),
    num_experts=meta.arch_int("expert_count"),
    num_experts_per_tok=meta.arch_int("expert_used_count"),
    moe_intermediate_size=meta.arch_int("expert_feed_forward_length"),
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
  )


def _gemma3_extra(meta: Metadata) -> dict[str, Any]:
  layers = meta.arch_int("block_count")
  hidden, heads = meta.arch_int("embedding_length"), meta.arch_int("attention.head_count")
  head_dim = meta.arch_int("attention.key_length", hidden // heads)
  # llama.cpp's gemma3 graph: every 6th layer full attention, local RoPE base 10000, the query
  # scaled by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) in the 27B model (62 layers).
  return dict(
    sliding_window=meta.arch_int("attention.sliding_window"),
    sliding_window_pattern=6,
    rope_local_base_freq=10000.0,
    query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
    hidden_activation="gelu_pytorch_tanh",
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
  )


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
  """How one llama.cpp architecture maps onto its HF class.

  Attributes:
    hf_name: the HF `architectures` entry (a jaxspec architecture).
    model_type: config.json's `model_type`.
    extra: the family's own config.json keys, from the metadata.
    permuted_qk: q/k rows interleaved per head for llama.cpp's RoPE (undone on read).
    norms_plus_one: RMSNorm weights stored as 1 + w (Gemma's zero-centred norms).
    sandwich: Gemma's four norms per layer (`SANDWICH_LAYER_NAMES`).
  """

  hf_name: str
  model_type: str
  extra: Callable[[Metadata], dict[str, Any]]
  permuted_qk: bool = False
  norms_plus_one: bool = False
  sandwich: bool = False


# llama.cpp's `general.architecture` → its HF mapping.
ARCHITECTURES = {
  "llama": GGUFArchitecture("LlamaForCausalLM", "llama", _llama_extra, permuted_qk=True),
  "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", _qwen2_extra),
  "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", _qwen3_extra),
  "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3moe_extra),
  "gemma3": GGUFArchitecture(
    "Gemma3ForCausalLM", "gemma3_text", _gemma3_extra, norms_plus_one=True, sandwich=True
  ),
}


_REQUIRED = object()


class Metadata:
  """A GGUF file's key/value metadata (decoded to Python values) and its tensor names."""

  def __init__(self, path: str, fields: dict[str, Any], tensor_names: set[str]):
    self.path = path
    self.fields = fields
    self.tensor_names = tensor_names
    self.arch = self.string("general.architecture")

  def _get(self, key: str, default: Any, kind: type | tuple) -> Any:
    if key not in self.fields:
      if default is _REQUIRED:
        raise ConfigError(f"{self.path}: GGUF metadata lacks {key}")
      return default
    value = self.fields[key]
    if isinstance(value, bool) or not isinstance(value, kind):
      what = {str: "a string", int: "an integer"}.get(kind, "a number")
      raise ConfigError(f"{self.path}: GGUF metadata {key} = {value!r} is not {what}")
    return value

  def string(self, key: str, default: Any = None) -> Any:
    return self._get(key, _REQUIRED if default is None else default, str)

  def arch_int(self, key: str, default: Any = None) -> Any:
    return self._get(f"{self.arch}.{key}", _REQUIRED if default is None else default, int)

  def arch_float(self, key: str, default: Any = None) -> Any:
    value = self._get(f"{self.arch}.{key}", _REQUIRED if default is None else default, (int, float))
    return float(value)

  def get(self, key: str, default: Any = None) -> Any:
    return self.fields.get(key, default)

  def has_tensor(self, name: str) -> bool:
    return name in self.tensor_names


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
  """config.json's rope_scaling from `{arch}.rope.scaling.*` (linear and YaRN)."""
  kind = meta.get(f"{meta.arch}.rope.scaling.type")
  if kind in (None, "none"):
    return None
  factor = meta.arch_float("rope.scaling.factor")
  if kind == "linear":
    return {"rope_type": "linear", "factor": factor}
  if kind == "yarn":
    original = meta.arch_int("rope.scaling.original_context_length")
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
  raise ConfigError(f"{meta.path}: {meta.arch}.rope.scaling.type {kind!r} is not supported")


def llama3_divisors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
  """What llama.cpp's converter stores as `rope_freqs.weight` for Llama 3's "llama3" RoPE
  scaling: each frequency's divisor (1 above the high band, `factor` below the low one, a
  smooth blend between)."""
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
  return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_scaling(meta: Metadata, divisors: np.ndarray, head_dim: int, theta: float) -> dict:
  """The rope_scaling behind a `rope_freqs.weight`: Llama 3's published band factors (1, 4,
  8192 original positions) with the stored maximum as `factor`, accepted only when they
  reproduce every stored divisor (any other tensor is refused, not approximated)."""
  scaling = {
    "rope_type": "llama3",
    "factor": float(np.max(divisors)),
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
  }
  want = llama3_divisors(theta, head_dim, scaling)
  if divisors.shape != want.shape or not np.allclose(divisors, want, rtol=1e-4, atol=0):
    raise ConfigError(
      f"{meta.path}: rope_freqs.weight holds RoPE frequency factors that Llama 3's llama3 "
      f"scaling (low_freq_factor 1, high_freq_factor 4, 8192 original positions) does not "
      f"give; jaxspec cannot recover the rope_scaling they were made from"
    )
  return scaling


def hf_config(meta: Metadata, rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
  """The config.json dict a HF checkpoint of the same model would hold (`rope_freqs`: the
  file's `rope_freqs.weight`, when it has one)."""
  if meta.arch not in ARCHITECTURES:
    raise ConfigError(
      f"{meta.path}: GGUF architecture {meta.arch!r} is not supported; jaxspec reads "
      f"{', '.join(ARCHITECTURES)}"
    )
  arch = ARCHITECTURES[meta.arch]
  hidden, heads = meta.arch_int("embedding_length"), meta.arch_int("attention.head_count")
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = meta.arch_int("vocab_size", len(tokens) if tokens else None)
  head_dim = meta.arch_int(
    "attention.key_length", meta.arch_int("rope.dimension_count", hidden // heads)
  )
  config: dict[str, Any] = {
    "architectures": [arch.hf_name],
    "model_type": arch.model_type,
    "vocab_size": vocab,
    "hidden_size": hidden,
    "num_hidden_layers": meta.arch_int("block_count"),
    "num_attention_heads": heads,
    "num_key_value_heads": meta.arch_int("attention.head_count_kv", heads),
    "head_dim": head_dim,
    "intermediate_size": meta.arch_int("feed_forward_length"),
    "max_position_embeddings": meta.arch_int("context_length"),
    "rms_norm_eps": meta.arch_float("attention.layer_norm_rms_epsilon"),
    "rope_theta": meta.arch_float("rope.freq_base", 10000.0),
    "rope_scaling": _rope_scaling(meta),
    "tie_word_embeddings": not meta.has_tensor("output.weight"),
    "torch_dtype": "float32",
  }
  for key in ("bos", "eos", "padding"):
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    if value is not None:
      config[f"{'pad' if key == 'padding' else key}_token_id"] = int(value)
  config.update(arch.extra(meta))
  if rope_freqs is not None:
    if config["rope_scaling"] is not None:
      raise ConfigError(f"{meta.path} states both rope.scaling.type and rope_freqs.weight")
    config["rope_scaling"] = _llama3_scaling(meta, rope_freqs, head_dim, config["rope_theta"])
  return config


# --------------------------------------------------------------------------------------------------
# Tensors under their HF names
# --------------------------------------------------------------------------------------------------


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row order: within each head, its rows [0, 2, 4, ..., 1, 3, ...]
  were stored interleaved ([0, D/2, 1, D/2 + 1, ...]); HF's rotate-half RoPE wants halves."""
  rest = w.shape[1:]
  return w.reshape(heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _hf_names(meta: Metadata, config: dict[str, Any]) -> dict[str, tuple[str, int | None]]:
  """HF tensor name → (GGUF tensor name, expert index or None) for every tensor of the file."""
  sandwich = ARCHITECTURES[meta.arch].sandwich
  layer_names = {v: k for k, v in (SANDWICH_LAYER_NAMES if sandwich else LAYER_NAMES).items()}
  global_names = {v: k for k, v in GLOBAL_NAMES.items()}
  experts = config.get("num_experts", 0)
  out: dict[str, tuple[str, int | None]] = {}
  unknown = []
  for name in sorted(meta.tensor_names - DERIVED):
    if name in global_names:
      out[global_names[name]] = (name, None)
      continue
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in layer_names:
      out[f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"] = (name, None)
    elif m and m.group(2) in EXPERT_NAMES and experts:
      proj = EXPERT_NAMES[m.group(2)]
      for e in range(experts):
        out[f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight"] = (name, e)
    else:
      unknown.append(name)
  if unknown:
    more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
    raise CheckpointError(
      f"{meta.path}: tensor(s) jaxspec's {meta.arch} reader does not know: {unknown[:5]}{more}"
    )
  return out


class GGUFTensorSource:
  """A GGUF file's tensors under HF names and shapes, dequantized to float32 as read.

  The interface of `safetensors_files.TensorSource` (keys, shape, get, file_of, close), so
  `jaxspec.io.hf.load_params` reads a GGUF as it reads a safetensors checkpoint.
  """

  def __init__(self, checkpoint: GGUFCheckpoint, unpermute: bool = True):
    self._ckpt = checkpoint
    self._names = _hf_names(checkpoint.meta, checkpoint.hf_config)
    self.file_of = {k: checkpoint.path for k in self._names}
    self._arch = ARCHITECTURES[checkpoint.meta.arch]
    self._unpermute = unpermute and self._arch.permuted_qk
    self._cached: tuple[str, np.ndarray] | None = None  # the last stacked expert tensor read

  def keys(self) -> set[str]:
    return set(self._names)

  def shape(self, name: str) -> tuple[int, ...]:
    gname, expert = self._names[name]
    shape = self._ckpt.file.tensors[gname].shape
    return shape[1:] if expert is not None else shape

  def get(self, name: str) -> np.ndarray:
    gname, expert = self._names[name]
    if expert is not None:
      if self._cached is None or self._cached[0] != gname:
        self._cached = (gname, self._ckpt.file.read(gname))
      return self._cached[1][expert]
    w = self._ckpt.file.read(gname)
    config = self._ckpt.hf_config
    if self._unpermute and gname.endswith(("attn_q.weight", "attn_k.weight")):
      key = "num_attention_heads" if gname.endswith("attn_q.weight") else "num_key_value_heads"
      w = unpermute_rows(w, config[key])
    if self._arch.norms_plus_one and gname.endswith("norm.weight"):
      w = w - 1.0  # stored as 1 + w
    return w

  def close(self) -> None:
    self._cached = None


class GGUFCheckpoint:
  """One GGUF file: its HF config dict, tensors (`tensor_source`) and tokenizer."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise CheckpointError(f"GGUF file {path!r} does not exist")
    self.path = path
    self.file = gguf_file.GGUFFile(path)
    self.meta = Metadata(path, self.file.fields, set(self.file.tensors))
    rope_freqs = self.file.read(ROPE_FREQS) if ROPE_FREQS in self.file.tensors else None
    self.hf_config = hf_config(self.meta, rope_freqs)

  def tensor_source(self, unpermute: bool = True) -> GGUFTensorSource:
    """The tensors under HF names (`unpermute=False` keeps llama.cpp's q/k row order: wrong,
    for tests that show the permutation matters)."""
    return GGUFTensorSource(self, unpermute)

  @property
  def chat_template(self) -> str | None:
    value = self.meta.get("tokenizer.chat_template")
    return value if isinstance(value, str) else None

  def tokenizer(self) -> Any:
    """The file's tokenizer (`jaxspec.io.tokenizer.Tokenizer`, chat template attached), or
    None when it has none (`tokenizer.ggml.model` absent or "none")."""
    return gguf_tokenizer.from_metadata(self.meta, self.path)
