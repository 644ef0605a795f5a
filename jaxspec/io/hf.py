"""Hugging Face checkpoints: `config.json` + (sharded) `*.safetensors` ↔ jaxspec parameters.

The on-disk names are the HF ones (`model.layers.{i}.self_attn.q_proj.weight`, per-expert
`mlp.experts.{e}.gate_proj.weight`, ...). MTP layers are stored after the main layers in the
DeepSeek-V3 layout, `model.layers.{num_hidden_layers + k}.{enorm,hnorm,eh_proj,shared_head.norm,
self_attn.*,mlp.*}`. Every tensor the architecture needs must be present with the right shape and
finite values; a tensor it does not use is an error too (the checkpoint is not the model the config
describes), except the few redundant ones published layouts carry, which are skipped with a
warning. Everything is checked once, as it is read, and named: never a silent fallback to random
weights, never a raw KeyError or JSONDecodeError. Files that are absent, unreadable or not valid
JSON / safetensors raise CheckpointError; valid JSON with bad contents raises ConfigError (for
config.json) or CheckpointError (for the shard index); both name the file.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.options import RunOptions
from jaxspec.io import architectures, layouts
from jaxspec.io import quantized as quantized_io
from jaxspec.models import decoder as decoder_lib
from jaxspec.models import target as target_lib
from jaxspec.quant.formats import QTensor
from jaxspec.quant.policy import contraction_axes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 1024**3
# Non-persistent buffers some exporters save anyway; recomputed from the config, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# --------------------------------------------------------------------------------------------------
# Name mapping
# --------------------------------------------------------------------------------------------------

# (hf suffix, jaxspec path inside the layer, kind). Kinds say how to reshape:
#   "in_heads": HF [heads*D, H]  ↔ jaxspec kernel [H, heads, D]
#   "out_heads": HF [H, heads*D] ↔ jaxspec kernel [heads, D, H]
#   "bias_heads": HF [heads*D]   ↔ jaxspec [heads, D]
#   "linear": HF [out, in] ↔ jaxspec [in, out];  "same": identical.
#   "conv": HF depthwise Conv1d weight [C, 1, K] ↔ jaxspec [K, C].
Entry = tuple[str, tuple[str, ...], str]


def _linear_attn_entries(config: ModelConfig) -> list[Entry]:
  """A Gated DeltaNet layer's tensors (Qwen3-Next's fused projections or Qwen3.5's four)."""
  if config.architecture == "Qwen3NextForCausalLM":
    projections = ("in_proj_qkvz", "in_proj_ba")
  else:
    projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
  e: list[Entry] = [
    (f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), "linear") for p in projections
  ]
  return e + [
    ("linear_attn.conv1d.weight", ("linear_attn", "conv_kernel"), "conv"),
    ("linear_attn.dt_bias", ("linear_attn", "dt_bias"), "same"),
    ("linear_attn.A_log", ("linear_attn", "A_log"), "same"),
    ("linear_attn.norm.weight", ("linear_attn", "norm"), "same"),
    ("linear_attn.out_proj.weight", ("linear_attn", "out_proj", "kernel"), "linear"),
  ]


# Gemma 4's layer tensors beyond a pre-norm layer's: its sandwich norms, per-layer input and
# output scalar.
GEMMA4_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
GEMMA4_PER_LAYER_INPUT: list[Entry] = [
  ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), "linear"),
  ("per_layer_projection.weight", ("per_layer_projection", "kernel"), "linear"),
  ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), "same"),
]


def layer_entries(
  config: ModelConfig,
  moe: bool,
  linear: bool = False,
  indexer: bool = False,
  sliding: bool = False,
  kv_shared: bool = False,
) -> list[Entry]:
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
  if config.is_gemma4:
    e += [(f"{n}.weight", (n, "scale"), "same") for n in GEMMA4_NORMS]
    e.append(("layer_scalar", ("layer_scalar",), "same"))
    if config.hidden_size_per_layer_input:
      e += GEMMA4_PER_LAYER_INPUT
  return e + _ffn_entries(config, moe)


def kv_shared_ignorable(config: ModelConfig) -> Callable[[str], bool]:
  """Gemma 4: the K/V tensors checkpoints may still hold for KV-shared layers, which never
  read them (transformers skips them on load too)."""
  names = {
    f"model.layers.{i}.self_attn.{p}.weight"
    for i in range(config.num_layers)
    if config.num_kv_shared_layers and config.is_kv_shared(i)
    for p in ("k_proj", "v_proj", "k_norm", "v_norm")
  }
  return lambda name: (text_name(name) or name) in names


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


# Where MTP layers live that transformers does not build (it skips them): left out with a
# warning when the config asks for none.
UNBUILT_MTP = {"MiMoV2FlashForCausalLM": "model.mtp."}
# Where an architecture's checkpoints keep the attention sinks (gpt-oss: `sinks`).
SINK_NAMES = {"MiMoV2FlashForCausalLM": "attention_sink_bias"}


def _attention_entries(
  config: ModelConfig, sliding: bool = False, kv_shared: bool = False
) -> list[Entry]:
  if config.is_mla:
    return _mla_entries(config)
  # Gemma 4: KV-shared layers have no K/V projections, full layers none for V where k_eq_v.
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
    name = SINK_NAMES.get(config.architecture, "sinks")
    e.append((f"self_attn.{name}", ("self_attn", "sinks"), "same"))
  return e


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
# Gemma 4's MoE block (beside the dense MLP): its router, stacked experts and norms.
GEMMA4_MOE: list[Entry] = [
  ("router.proj.weight", ("moe", "router"), "linear"),
  ("router.scale", ("moe", "router_scale"), "same"),
  ("router.per_expert_scale", ("moe", "per_expert_scale"), "same"),
  ("experts.gate_up_proj", ("moe", "gate_up_proj"), "experts_linear"),
  ("experts.down_proj", ("moe", "down_proj"), "experts_linear"),
] + [
  (f"{n}.weight", (n, "scale"), "same")
  for n in (
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
  )
]


def _ffn_entries(config: ModelConfig, moe: bool) -> list[Entry]:
  e: list[Entry] = []
  if config.is_gemma4:  # the dense MLP in every layer, the MoE block beside it
    dense = [(f"mlp.{p}.weight", ("mlp", p, "kernel"), "linear") for p in MLP_NAMES]
    return dense + (GEMMA4_MOE if moe else [])
  if config.fused_gate_up:  # gpt-oss: stacked experts in jaxspec's own [E, in, out] layout
    return e + [
      ("mlp.router.weight", ("mlp", "router"), "linear"),
      ("mlp.router.bias", ("mlp", "router_bias"), "same"),
      ("mlp.experts.gate_up_proj", ("mlp", "gate_up_proj"), "same"),
      ("mlp.experts.gate_up_proj_bias", ("mlp", "gate_up_bias"), "same"),
      ("mlp.experts.down_proj", ("mlp", "down_proj"), "same"),
      ("mlp.experts.down_proj_bias", ("mlp", "down_bias"), "same"),
    ]
  if not moe:
    e += [(f"mlp.{p}.weight", ("mlp", p, "kernel"), "linear") for p in MLP_NAMES]
    return e
  if config.architecture == "MiniMaxM2ForCausalLM":
    return _minimax_moe_entries(config)
  e.append(("mlp.gate.weight", ("mlp", "router"), "linear"))
  if config.router == "sigmoid":
    e.append(("mlp.gate.e_score_correction_bias", ("mlp", "e_score_correction_bias"), "same"))
  for x in range(config.num_experts):
    e += [
      (f"mlp.experts.{x}.{p}.weight", ("mlp", p, f"#{x}"), "linear")
      for p in ("gate_proj", "up_proj", "down_proj")
    ]
  if config.n_shared_experts:
    e += [
      (f"mlp.shared_experts.{p}.weight", ("mlp", "shared_experts", p, "kernel"), "linear")
      for p in ("gate_proj", "up_proj", "down_proj")
    ]
  if config.shared_expert_intermediate_size:
    e += [
      (f"mlp.shared_expert.{p}.weight", ("mlp", "shared_expert", p, "kernel"), "linear")
      for p in ("gate_proj", "up_proj", "down_proj")
    ]
    e.append(("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), "linear"))
  return e


# MiniMax-M2's expert projections under their Mixtral-style names (w1 gate, w3 up, w2 down).
MINIMAX_EXPERT_NAMES = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _minimax_moe_entries(config: ModelConfig) -> list[Entry]:
  """A MiniMax-M2 MoE layer's tensors as published (and as transformers saves them):
  `block_sparse_moe.{gate.weight, e_score_correction_bias, experts.{e}.w{1,2,3}.weight}`."""
  moe = "block_sparse_moe"
  e: list[Entry] = [
    (f"{moe}.gate.weight", ("mlp", "router"), "linear"),
    (f"{moe}.e_score_correction_bias", ("mlp", "e_score_correction_bias"), "same"),
  ]
  for x in range(config.num_experts):
    e += [
      (f"{moe}.experts.{x}.{w}.weight", ("mlp", p, f"#{x}"), "linear")
      for w, p in MINIMAX_EXPERT_NAMES
    ]
  return e


MIMO_MTP_RENAMES = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}


def _mtp_entries(config: ModelConfig) -> list[Entry]:
  """An MTP layer's tensors, relative to `mtp_prefix`."""
  if config.is_hybrid:  # Qwen3.5 / Qwen3-Next: mtp.{fc, pre_fc_norm_*, norm, layers.0.*}
    names, block = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"), "layers.0."
  elif config.mtp_sliding:  # MiMo-V2-Flash: model.mtp.layers.{k}.{enorm, ..., pre_mlp_layernorm}
    names, block = ("enorm", "hnorm", "eh_proj", "final_layernorm"), ""
  else:
    names, block = ("enorm", "hnorm", "eh_proj", "shared_head.norm"), ""
  e: list[Entry] = [
    (f"{names[0]}.weight", ("enorm", "scale"), "same"),
    (f"{names[1]}.weight", ("hnorm", "scale"), "same"),
    (f"{names[2]}.weight", ("eh_proj", "kernel"), "linear"),
    (f"{names[3]}.weight", ("post_norm", "scale"), "same"),
  ]
  layer = layer_entries(
    config, config.mtp_is_moe, indexer=config.is_dsa, sliding=config.mtp_sliding
  )
  if config.mtp_sliding:  # MiMo's checkpoints name the MLP's norm for what it precedes
    layer = [(MIMO_MTP_RENAMES.get(hf, hf), path, kind) for hf, path, kind in layer]
  return e + [(block + hf, ("block", *path), kind) for hf, path, kind in layer]


def tensor_map(config: ModelConfig) -> Iterator[tuple[str, tuple, int | None, str]]:
  """Yields (hf_name, param path, index into the stacked layer axis or None, kind)."""
  yield "model.embed_tokens.weight", ("embed",), None, "same"
  yield "model.norm.weight", ("norm", "scale"), None, "same"
  if not config.tie_word_embeddings:
    yield "lm_head.weight", ("lm_head", "kernel"), None, "linear"
  if config.hidden_size_per_layer_input:  # Gemma 4
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


def mtp_prefix(config: ModelConfig, k: int) -> str:
  """Where MTP layer k's tensors live: after the main layers (DeepSeek-V3, GLM) or in the
  `mtp.` module (Qwen3.5 / Qwen3-Next)."""
  if config.mtp_sliding:
    return f"model.mtp.layers.{k}."
  return "mtp." if config.is_hybrid else f"model.layers.{config.num_layers + k}."


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _listing(names: list[str], n: int = 5) -> str:
  """The first `n` names and how many more: error messages stay one readable line."""
  more = f" (and {len(names) - n} more)" if len(names) > n else ""
  return f"{names[:n]}{more}"


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is not readable JSON: {e}") from None


def _allowed_roots(model_dir: str) -> list[str]:
  """Real directories a checkpoint's files may resolve into: the directory itself and, for a
  Hugging Face hub cache snapshot (`models--org--name/snapshots/<rev>`), whose files are
  symlinks into the repository's `blobs/`, that `blobs/` too."""
  root = os.path.realpath(model_dir)
  roots = [root]
  parts = root.split(os.sep)
  if "snapshots" in parts[:-1]:
    repo = os.sep.join(parts[: len(parts) - 1 - parts[::-1].index("snapshots")])
    if os.path.isdir(os.path.join(repo, "blobs")):
      roots.append(os.path.join(repo, "blobs"))
  return roots


def confined_path(model_dir: str, name: str, index_path: str) -> str:
  """`model_dir/name` for a shard file that an index names, if it stays inside model_dir.

  An index is data from wherever the checkpoint came from: an absolute name, a `..` or a
  symlink leading out of the directory would make loading read an arbitrary file, so each is
  a CheckpointError (symlinks into the HF hub cache's `blobs/` are how that cache stores
  files, and are allowed).
  """
  if not isinstance(name, str) or not name or "\0" in name:
    raise CheckpointError(f"{index_path}: shard file name {name!r} is not a file name")
  path = os.path.join(model_dir, name)
  real = os.path.realpath(path)
  if os.path.isabs(name) or not any(
    os.path.commonpath([root, real]) == root for root in _allowed_roots(model_dir)
  ):
    raise CheckpointError(
      f"{index_path}: shard path {name!r} is outside the model directory {model_dir}"
    )
  return os.path.normpath(path)


def _read_weight_map(model_dir: str, index_path: str) -> dict[str, str]:
  """tensor name → shard path of a `model.safetensors.index.json`, every shard confined."""
  data = _read_json(index_path)
  weight_map = data.get("weight_map") if isinstance(data, dict) else None
  if not isinstance(weight_map, dict) or not weight_map:
    raise CheckpointError(
      f"{index_path} has no weight_map object mapping tensor names to shard files"
    )
  bad = [f"{k}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)]
  if bad:
    raise CheckpointError(
      f"{index_path}: weight_map must map tensor names to shard file names, got {_listing(bad)}"
    )
  shard = {v: confined_path(model_dir, v, index_path) for v in set(weight_map.values())}
  return {k: shard[v] for k, v in weight_map.items()}


def check_unexpected(
  model_dir: str,
  present: Iterable[str],
  known: Iterable[str],
  layout: str,
  ignorable: Callable[[str], bool] = lambda name: False,
) -> None:
  """Raises CheckpointError naming the tensors in `present` that nothing reads.

  A tensor the layout does not use means the checkpoint is not what the config describes
  (another architecture, more layers, biases the config turns off): loading the rest would run
  a different model than the one saved. Names ending in IGNORED_SUFFIXES and those `ignorable`
  accepts are redundant in published layouts: they are skipped with a warning naming them.
  """
  extra = sorted(set(present) - set(known))
  skipped = [n for n in extra if n.endswith(IGNORED_SUFFIXES) or ignorable(n)]
  unknown = sorted(set(extra) - set(skipped))
  if unknown:
    raise CheckpointError(
      f"checkpoint in {model_dir} has {len(unknown)} tensor(s) {layout} does not use "
      f"(another architecture or config?): {_listing(unknown)}"
    )
  if skipped:
    warnings.warn(
      f"checkpoint in {model_dir}: ignoring {len(skipped)} tensor(s) {layout} does not use: "
      f"{_listing(skipped)}",
      stacklevel=3,
    )


def check_finite(name: str, w: np.ndarray, where: str) -> None:
  """CheckpointError if tensor `name` (already in memory) holds NaN or Inf: one cheap pass."""
  if not np.isfinite(w).all():
    raise CheckpointError(f"tensor {name} in {where} holds NaN or Inf values")


# Vision-language checkpoints wrap the text model under a prefix; jaxspec reads the text model
# under its own names. (stored prefix, text-layout prefix), longest first:
# * `model.language_model.`: transformers' layout (Qwen3.5, and Kimi-K2.5 in memory);
# * `language_model.model.` / `language_model.lm_head.`: the LLaVA-style layout published
#   Kimi-K2.5 checkpoints store (transformers' kimi_k25 conversion mapping renames it on load).
# (transformers 5.24's save_pretrained of Kimi-K2.5 reverses that mapping lossily, e.g. the
# text q_proj written as `self_wqkv`: such a save is not a layout to read.)
TEXT_PREFIXES = (
  ("model.language_model.", "model."),
  ("language_model.model.", "model."),
  ("language_model.lm_head.", "lm_head."),
)
# The vision tower and projector of those checkpoints: left out with a warning.
VISION_PREFIXES = (
  "model.visual.",
  "model.vision_tower.",
  "model.audio_tower.",  # Gemma 4's audio encoder and both embedders
  "model.embed_vision.",
  "model.embed_audio.",
  "model.mm_projector.",
  "vision_tower.",
  "mm_projector.",
)


def text_name(name: str) -> str | None:
  """A wrapped text-model tensor's name in the text layout, or None if `name` is not one."""
  for stored, text in TEXT_PREFIXES:
    if name.startswith(stored):
      return text + name[len(stored) :]
  return None


class _TensorSource:
  """Lazy access to the tensors of one checkpoint directory (single file or sharded)."""

  def __init__(self, model_dir: str, quiet: bool = False):
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
      self.file_of = _read_weight_map(model_dir, index)
      missing = sorted({v for v in self.file_of.values() if not os.path.exists(v)})
      if missing:
        raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
    elif os.path.exists(single):
      self.file_of = {k: single for k in self._keys(single)}
    else:
      raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    self._handles: dict[str, Any] = {}
    self._stored: dict[str, str] = {}  # name read → name in the files (multimodal layout)
    if any(text_name(k) is not None for k in self.file_of):
      self._text_only(model_dir, quiet)

  def _text_only(self, model_dir: str, quiet: bool) -> None:
    """A vision-language checkpoint (Qwen3.5, Kimi-K2.5): its text model's tensors under the
    text layout's names (`TEXT_PREFIXES`), the vision tower's and projector's
    (`VISION_PREFIXES`) left out with a warning."""
    visual = [k for k in self.file_of if k.startswith(VISION_PREFIXES)]
    files = {}
    for k, path in self.file_of.items():
      if k.startswith(VISION_PREFIXES):
        continue
      name = text_name(k) or k
      if name in files:
        raise CheckpointError(f"{model_dir} holds both {self._stored.get(name, name)} and {k}")
      files[name] = path
      self._stored[name] = k
    self.file_of = files
    if visual and not quiet:
      where = sorted({p + "*" for p in VISION_PREFIXES for v in visual if v.startswith(p)})
      warnings.warn(
        f"checkpoint in {model_dir}: ignoring the {len(visual)} vision-tower tensor(s) "
        f"({', '.join(where)}): jaxspec runs the text model",
        stacklevel=4,
      )

  @staticmethod
  def _open(path: str):
    try:
      return safe_open(path, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): {e}")

  def _keys(self, path: str) -> list[str]:
    with self._open(path) as f:
      return list(f.keys())

  def keys(self) -> set[str]:
    return set(self.file_of)

  def shape(self, name: str) -> tuple[int, ...]:
    try:
      return tuple(self._handle(name).get_slice(self._stored.get(name, name)).get_shape())
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"cannot read tensor {name} from {self.file_of[name]}: {e}") from None

  def _handle(self, name: str):
    path = self.file_of[name]
    if path not in self._handles:
      self._handles[path] = self._open(path).__enter__()
    return self._handles[path]

  def get(self, name: str) -> np.ndarray:
    f = self._handle(name)
    stored = self._stored.get(name, name)
    try:
      if f.get_slice(stored).get_dtype() == "BF16":
        with safe_open(self.file_of[name], framework="flax") as fj:
          return np.asarray(fj.get_tensor(stored))
      return f.get_tensor(stored)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(
        f"cannot read tensor {name} from {self.file_of[name]} (truncated or corrupt?): {e}"
      )

  def close(self) -> None:
    for h in self._handles.values():
      h.__exit__(None, None, None)
    self._handles.clear()


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _get_path(tree: Any, path: tuple[str, ...]) -> Any:
  for p in path:
    tree = tree[p]
  return tree


def read_config(model_dir: str) -> dict:
  """The config.json of `model_dir` as a dict.

  Absent, unreadable or not valid JSON: CheckpointError (the checkpoint is damaged). Valid JSON
  that is not an object: ConfigError (a bad config). Both name the file.
  """
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"no config.json in {model_dir}")
  hf = _read_json(path)
  if not isinstance(hf, dict):
    raise ConfigError(f"{path} must hold a JSON object, got a JSON {type(hf).__name__}")
  return hf


def load_config(model_dir: str, **overrides: Any) -> tuple[ModelConfig, dict]:
  """(ModelConfig, config.json dict) of a checkpoint directory; a ConfigError names the file."""
  hf_config = read_config(model_dir)
  try:
    return architectures.config_from_hf(hf_config, **overrides), hf_config
  except ConfigError as e:
    path = os.path.join(model_dir, "config.json")
    given = f" (with overrides {', '.join(sorted(overrides))})" if overrides else ""
    raise ConfigError(f"{path}{given}: {e}") from None


def _layer_index(name: str) -> int | None:
  m = re.match(r"model\.layers\.(\d+)\.", name)
  return int(m.group(1)) if m else None


def load_params(
  model_dir: str,
  config: ModelConfig,
  *,
  extra_layers_ok: bool = False,
  quantization: dict | None = None,
) -> Any:
  """Reads the parameters of `config` from a HF checkpoint directory (numpy, param_dtype).

  Each tensor is checked as it is read: present, of the config's shape, finite once cast to
  param_dtype. Tensors the config does not use raise (`check_unexpected`), except a tied
  `lm_head.weight` (transformers ignores it too), a hybrid target's `mtp.*` module when the
  config has no MTP layer (undeclared, or `num_mtp_layers=0` asked for) and, with `extra_layers_ok` (the caller asked
  for fewer layers than stored), the layers past the ones loaded: those warn.
  """
  depth = config.num_layers + config.num_mtp_layers

  def ignorable(name: str) -> bool:
    if config.tie_word_embeddings and name == "lm_head.weight":
      return True
    if config.is_hybrid and not config.num_mtp_layers and name.startswith("mtp."):
      return True  # an MTP module the config leaves out (num_mtp_layers=0): transformers' skip
    unbuilt = UNBUILT_MTP.get(config.architecture)
    if unbuilt and not config.num_mtp_layers and name.startswith(unbuilt):
      return True  # MTP layers the config leaves out (num_mtp_layers=0): transformers' skip
    if shared_kv(name):
      return True  # Gemma 4: K/V of KV-shared layers, which read another layer's
    i = _layer_index(name)
    return extra_layers_ok and i is not None and i >= depth

  shared_kv = kv_shared_ignorable(config)

  src = _TensorSource(model_dir)
  stacked = config.with_options(scan_layers=True)  # read stacked
  shapes = target_lib.param_shapes(stacked)
  axes_tree = target_lib.logical_axes(stacked)
  dtype = (
    np.dtype(ml_dtypes.bfloat16)
    if config.param_dtype == "bfloat16"
    else np.dtype(config.param_dtype)
  )
  params: dict = {}
  needed = list(tensor_map(config))
  quantized = _quantized_entries(quantization, src, needed)
  missing = [hf for hf, *_ in needed if hf not in src.file_of and hf not in quantized]
  if missing:
    src.close()
    more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
    raise CheckpointError(
      f"checkpoint in {model_dir} lacks {len(missing)} tensor(s) the "
      f"config needs: {missing[:10]}{more}"
    )
  try:
    expected = [hf for hf, *_ in needed if hf not in quantized]
    expected += [n for names in quantized.values() for n in names[1]]
    check_unexpected(model_dir, src.keys(), expected, "the config", ignorable)
    stacks: dict = {}
    for hf, path, layer_idx, kind in needed:
      expert = None
      if path[-1].startswith("#"):
        expert, path = int(path[-1][1:]), path[:-1]
      full = _get_path(shapes, path)
      per_layer = full.shape[1:] if layer_idx is not None else full.shape
      per_item = per_layer[1:] if expert is not None else per_layer
      if hf in quantized and quantized[hf][0] == "fp8_block":  # stored per weight and expert
        block = tuple(int(b) for b in quantization["weight_block_size"])
        q = quantized_io.import_fp8_block(src, hf, kind, tuple(per_item), block, config.param_dtype)
        slot = stacks.setdefault(path, {})
        if expert is None:
          slot[layer_idx] = q
        else:
          slot.setdefault(layer_idx, []).append(q)
        continue
      if hf in quantized:
        if expert in (None, 0):  # a layer's experts are stored (and read) as one stack
          fmt, _, base = quantized[hf]
          axes = contraction_axes(_get_path(axes_tree, path))
          q = quantized_io.import_qtensor(
            src, base, fmt, kind, tuple(per_layer), axes, config.param_dtype
          )
          stacks.setdefault(path, {})[layer_idx] = q
        continue
      want = layouts.hf_shape(per_item, kind)
      got = src.shape(hf)
      if got != want:
        raise CheckpointError(
          f"tensor {hf} has shape {list(got)}, but the config implies {list(want)}"
        )
      raw = src.get(hf)
      with np.errstate(over="ignore"):  # an overflow is reported below, naming the tensor
        w = layouts.to_jax_layout(raw, kind, per_item).astype(dtype)
      if not np.isfinite(w).all():
        check_finite(hf, raw, src.file_of[hf])
        raise CheckpointError(
          f"tensor {hf} in {src.file_of[hf]} overflows param_dtype {config.param_dtype}"
        )
      try:
        buf = _get_path(params, path)
      except KeyError:
        buf = np.zeros(full.shape, dtype)
        _set_path(params, path, buf)
      index = tuple(i for i in (layer_idx, expert) if i is not None)
      buf[index] = w
  finally:
    src.close()

  def stack(qs: list) -> QTensor:
    return qs[0].replace(
      values=np.stack([q.values for q in qs]), scales=np.stack([q.scales for q in qs])
    )

  for path, by_layer in stacks.items():
    by_layer = {j: stack(q) if isinstance(q, list) else q for j, q in by_layer.items()}
    if None in by_layer:
      _set_path(params, path, by_layer[None])
    else:
      _set_path(params, path, stack([by_layer[j] for j in range(len(by_layer))]))
  # Unscanned: one view per layer, each its own buffer once placed on a device.
  return params if config.options.scan_layers else decoder_lib.unstack_layer_params(config, params)


def _quantized_entries(quantization: dict | None, src: "_TensorSource", needed: list) -> dict:
  """{hf name: (format, stored names, base)} of the weights a jaxspec-quantized checkpoint
  holds quantized (none unless config.json's quantization_config says quant_method jaxspec)."""
  method = (quantization or {}).get("quant_method")
  if method is None:
    return {}
  names, out = src.keys(), {}
  if method == "fp8" and quantization.get("weight_block_size"):
    for hf, *_ in needed:
      if f"{hf}_scale_inv" in names:
        out[hf] = ("fp8_block", (hf, f"{hf}_scale_inv"), hf)
    return out
  if method not in (quantized_io.QUANT_METHOD, quantized_io.HF_MXFP4_METHOD):
    raise CheckpointError(
      f"quantization_config quant_method {method!r} is not supported (jaxspec reads its own "
      f"{quantized_io.QUANT_METHOD!r} checkpoints, gpt-oss's 'mxfp4' ones and block-scaled "
      f"'fp8' ones)"
    )
  for hf, path, _, _ in needed:
    expert = path[-1].startswith("#")
    base = quantized_io.expert_base(hf) if expert else quantized_io.base_name(hf)
    fmt = quantized_io.stored_format(names, base)
    if fmt is None:
      continue
    stored = (
      (f"{base}_blocks", f"{base}_scales")
      if fmt == "mxfp4"
      else (f"{base}.weight", f"{base}.weight_scale")
    )
    out[hf] = (fmt, stored, base)
  return out


def _without_absent_mtp_layers(
  model_dir: str, config: ModelConfig, hf_config: dict
) -> tuple[ModelConfig, dict]:
  """Drops the MTP layers that config.json declares when the checkpoint holds none of them.

  transformers' `save_pretrained` of a Glm4MoeForCausalLM keeps `num_nextn_predict_layers`
  in config.json but writes no `model.layers.{num_hidden_layers + k}.*` tensors (its model has
  no MTP modules); of a Qwen3.5 / Qwen3-Next, `mtp_num_hidden_layers` and no `mtp.*`. Such a checkpoint is a complete target: it loads with a warning and
  `num_mtp_layers = 0`. A checkpoint holding some but not all MTP tensors is left alone, so
  that `load_params` names the missing ones.
  """
  names = _TensorSource(model_dir, quiet=True).keys()
  prefixes = tuple(mtp_prefix(config, k) for k in range(config.num_mtp_layers))
  if any(name.startswith(prefixes) for name in names):
    return config, hf_config
  key = "mtp_num_hidden_layers" if config.is_hybrid else "num_nextn_predict_layers"
  warnings.warn(
    f"checkpoint in {model_dir} declares {config.num_mtp_layers} MTP layer(s) ({key}) but "
    f"holds none of their tensors ({prefixes[0]}*); the MTP layers are absent, so it loads "
    f"without them and MTP drafting is unavailable for this model",
    stacklevel=3,
  )
  hf_config = dict(hf_config)
  for key in ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"):
    if key in hf_config:
      hf_config[key] = 0
  return config.replace(num_mtp_layers=0), hf_config


def load_model(
  model_dir: str,
  scan_layers: bool = False,
  options: RunOptions | None = None,
  **config_overrides: Any,
) -> target_lib.TargetModel:
  """Loads config.json, the safetensors weights and tokenizer.json (when present).

  The layout is decoding's unless asked: by default (`scan_layers=False`) each layer keeps its
  own weight buffers, read in place instead of copied out of a stack every step (a 2-3x
  faster decode: 31% of the matvec bandwidth scanned against ~70% unrolled on a 1.5 GB dense
  model; see RunOptions.scan_layers). Training asks for `scan_layers=True`: each layer run's
  weights stacked for `nn.scan` (compile time flat in depth). `scan_layers` sets the layout
  whatever `options.scan_layers` says.

  `options` say how to run the model (kernels, chunks, dtypes: `RunOptions`);
  `config_overrides` are ModelConfig (architecture) fields.

  MTP layers that config.json declares but the checkpoint holds none of (what transformers'
  `save_pretrained` writes) are dropped with a warning: `config.num_mtp_layers` is then 0 and
  the returned `hf_config` says so too. With an explicit `num_mtp_layers` override they are
  required, as are the rest of a partially present MTP layer set.
  """
  if not os.path.isdir(model_dir):
    raise CheckpointError(f"model directory {model_dir!r} does not exist")
  if options is not None:
    config_overrides["options"] = options
  config, hf_config = load_config(model_dir, **config_overrides)
  config = config.with_options(scan_layers=scan_layers)
  if config.num_mtp_layers and "num_mtp_layers" not in config_overrides:
    config, hf_config = _without_absent_mtp_layers(model_dir, config, hf_config)
  fewer_layers = bool({"num_layers", "num_mtp_layers"} & set(config_overrides))
  params = load_params(
    model_dir,
    config,
    extra_layers_ok=fewer_layers,
    quantization=hf_config.get("quantization_config"),
  )
  params = jax.tree_util.tree_map(jnp.asarray, params)
  tokenizer = None
  if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
    from jaxspec.io import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    tokenizer = tokenizer_lib.Tokenizer.from_dir(model_dir)
  return target_lib.TargetModel(config, params, tokenizer, hf_config)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def export_tensors(config: ModelConfig, params: Any) -> dict[str, np.ndarray]:
  """The HF-named tensors of a parameter tree (either layer layout)."""
  host = jax.tree_util.tree_map(np.asarray, params)
  if not config.options.scan_layers:
    host = jax.tree_util.tree_map(np.asarray, decoder_lib.stack_layer_params(config, host))
  out: dict[str, np.ndarray] = {}
  for hf, path, layer_idx, kind in tensor_map(config):
    expert = None
    if path[-1].startswith("#"):
      expert, path = int(path[-1][1:]), path[:-1]
    w = _get_path(host, path)
    if isinstance(w, QTensor):  # stored in its format (io/quantized.py)
      if layer_idx is not None:
        w = w.replace(values=w.values[layer_idx], scales=w.scales[layer_idx])
      if w.format == "fp8_block":  # as imported: one tensor per weight and expert
        if expert is not None:
          w = w.replace(values=w.values[expert], scales=w.scales[expert])
        out.update(quantized_io.export_fp8_block(w, hf))
        continue
      if expert is None:
        out.update(quantized_io.export_qtensor(w, kind, quantized_io.base_name(hf)))
      elif expert == 0:  # the layer's whole stack of experts, once
        out.update(quantized_io.export_qtensor(w, kind, quantized_io.expert_base(hf)))
      continue
    if layer_idx is not None:
      w = w[layer_idx]
    if expert is not None:
      w = w[expert]
    out[hf] = np.ascontiguousarray(layouts.to_hf_layout(w, kind))
  return out


def _save_file(tensors: dict[str, np.ndarray], path: str) -> None:
  if any(t.dtype == ml_dtypes.bfloat16 for t in tensors.values()):
    from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel

    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, path, metadata={"format": "pt"})
  else:
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    save_file(tensors, path, metadata={"format": "pt"})


def save_hf(
  model: target_lib.TargetModel, out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
  """Writes config.json, model.safetensors (sharded with an index when large) and tokenizer."""
  os.makedirs(out_dir, exist_ok=True)
  hf_config = dict(model.hf_config or {})
  hf_config.update(architectures.config_to_hf(model.config))
  is_q = lambda x: isinstance(x, QTensor)
  leaves = jax.tree_util.tree_leaves(model.params, is_leaf=is_q)
  used = sorted({x.format for x in leaves if is_q(x)})
  if "fp8_block" in used:  # an imported block-scaled FP8 checkpoint: its own config
    if used != ["fp8_block"]:
      raise ConfigError(f"cannot save block-scaled FP8 weights beside {used} in one checkpoint")
  elif quantized_io.is_hf_mxfp4(model.config, model.params):
    hf_config["quantization_config"] = quantized_io.hf_mxfp4_config()
  elif used:
    report = model.quant_report
    hf_config["quantization_config"] = {
      "quant_method": quantized_io.QUANT_METHOD,
      "formats": used,
      "policy": [list(r) for r in report.policy] if report is not None else None,
    }
  else:
    hf_config.pop("quantization_config", None)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  tensors = export_tensors(model.config, model.params)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += nbytes
  if len(shards) == 1:
    _save_file(shards[0], os.path.join(out_dir, SINGLE_FILE))
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      _save_file(shard, os.path.join(out_dir, fname))
      weight_map.update({k: fname for k in shard})
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump(
        {
          "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
          "weight_map": weight_map,
        },
        f,
        indent=2,
        sort_keys=True,
      )
  if model.tokenizer is not None:
    model.tokenizer.save_hf(out_dir)


def enable_transformers_mtp(hf_model: Any) -> None:
  """Lets transformers' `generate(use_mtp=True)` find MTP layers stored after the main layers.

  transformers 5.24 locates Glm4Moe MTP weights through the class attribute
  `_keys_to_ignore_on_load_unexpected`, hard-coded to GLM-4.5's layer numbers (46, 92); a model
  with N main layers stores its MTP layer k as `model.layers.{N + k}.*` (the DeepSeek layout
  that jaxspec writes). This sets the attribute on the loaded instance only.
  """
  n = hf_model.config.num_hidden_layers
  hf_model._keys_to_ignore_on_load_unexpected = [  # pylint: disable=protected-access
    rf"model\.layers\.{n + k}\..*" for k in range(hf_model.config.num_mtp_layers)
  ]
