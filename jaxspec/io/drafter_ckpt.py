"""Published drafter checkpoints: DFlash (z-lab) and EAGLE-3 (SafeAILab / SpecForge) layouts.

DFlash (`DFlashDraftModel`): config.json is a Qwen3 config plus `block_size`,
`dflash_config.{mask_token_id, target_layer_ids}`, `num_target_layers` and optional
`layer_types` / `sliding_window`; tensors are named as the PyTorch module's state dict:
`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.input_layernorm.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`
(+ `.bias` with attention_bias), `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`. No embedding or LM head: the target's are shared.
jaxspec adds an optional draft vocabulary (a subset of the target's head rows that drafting
scores): `draft_vocab_size` in config.json and EAGLE-3's `d2t` / `t2d` tensors.

EAGLE-3 (`LlamaForCausalLMEagle3`): a Llama config with `draft_vocab_size`, optional
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc.weight`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t` (int64) and `t2d` (bool) for a reduced vocabulary,
optionally `embed_tokens.weight` and SpecForge's `fc_norm.{0,1,2}.weight`. yuhuili's heads
(e.g. EAGLE3-LLaMA3.1-Instruct-8B) ship the same tensors as a `pytorch_model.bin`, read with
the weights-only unpickler (`io.torch_bin`); SpecForge's as safetensors.

Loading checks every field of config.json for its type (`io.architectures.HFConfigReader`) and
every tensor's presence, shape and finiteness, and rejects unknown tensors
(`io.safetensors_files.check_unexpected`; a sharded index is confined to the checkpoint directory
as for targets); export writes the same layout back, in the dtype the weights were loaded in, so
import → export is exact.

This module reads and writes the checkpoints whole (`load_dflash` / `save_dflash`, `load_eagle3` /
`save_eagle3`: config.json ↔ drafter config, safetensors ↔ parameter trees, EAGLE-3's vocabulary
maps) but imports no drafter (io sits below drafters): a loader is handed the drafter's config
class and its parameter shapes, and returns a `DrafterCheckpoint` that the drafter binds to a
target (`jaxspec.drafters.dflash.load_dflash`, `jaxspec.drafters.eagle3.load_eagle3`);
`jaxspec.load_drafter` / `save_drafter` dispatch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator, Optional

import jax
import ml_dtypes
import numpy as np

from jaxspec.config_checks import ROPE_TYPES
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.io.architectures.reader import HFConfigReader
from jaxspec.io import layouts
from jaxspec.io.hf import read_config
from jaxspec.io.safetensors_files import (
  INDEX_FILE,
  SINGLE_FILE,
  TensorSource,
  check_finite,
  check_unexpected,
  write_file,
)
from jaxspec.io.torch_bin import BIN_FILE, TorchBinSource

DFLASH_ARCH = "DFlashDraftModel"
GEMMA4_ASSISTANT_ARCH = "Gemma4AssistantForCausalLM"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# Tapped layers: layer outputs under eagle_config (SpecForge, SGLang), layer inputs at the top
# level (vLLM); see _eagle3_layer_ids.
EAGLE3_IDS_KEY = "eagle_aux_hidden_state_layer_ids"

# (hf suffix, param path, kind); kinds as in jaxspec.io.layouts:
#   same: identical; linear: HF [out, in] ↔ [in, out]; in_heads: HF [heads·D, in] ↔ [in, heads, D];
#   out_heads: HF [H, heads·D] ↔ [heads, D, H]; bias_heads: HF [heads·D] ↔ [heads, D].
Entry = tuple[str, tuple[str, ...], str]


def _attn_mlp_entries(bias: bool, qk_norm: bool) -> list[Entry]:
  e: list[Entry] = [
    ("input_layernorm.weight", ("input_layernorm", "scale"), "same"),
    ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), "same"),
    ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), "in_heads"),
    ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), "in_heads"),
    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), "in_heads"),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "out_heads"),
  ]
  if bias:
    e += [
      (f"self_attn.{p}.bias", ("self_attn", p, "bias"), "bias_heads")
      for p in ("q_proj", "k_proj", "v_proj")
    ]
    e.append(("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "same"))
  if qk_norm:
    e += [
      ("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), "same"),
      ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), "same"),
    ]
  e += [
    (f"mlp.{p}.weight", ("mlp", p, "kernel"), "linear")
    for p in ("gate_proj", "up_proj", "down_proj")
  ]
  return e


def dflash_tensor_map(config: Any) -> Iterator[Entry]:
  """HF name, parameter path and layout kind of every tensor of a DFlashConfig."""
  yield "fc.weight", ("fc", "kernel"), "linear"
  yield "hidden_norm.weight", ("hidden_norm", "scale"), "same"
  yield "norm.weight", ("norm", "scale"), "same"
  for i in range(config.num_layers):
    for hf, path, kind in _attn_mlp_entries(config.attention_bias, qk_norm=True):
      yield f"layers.{i}.{hf}", (f"layers_{i}", *path), kind


def eagle3_tensor_map(config: Any) -> Iterator[Entry]:
  """HF name, parameter path and layout kind of every tensor of an Eagle3Config."""
  yield "fc.weight", ("fc", "kernel"), "linear"
  if config.fc_norm:
    for i in range(3):
      yield f"fc_norm.{i}.weight", (f"fc_norm_{i}", "scale"), "same"
  yield "norm.weight", ("norm", "scale"), "same"
  yield "lm_head.weight", ("lm_head", "kernel"), "linear"
  if config.has_embedding:
    yield "embed_tokens.weight", ("embed",), "same"
  yield "midlayer.hidden_norm.weight", ("midlayer", "hidden_norm", "scale"), "same"
  for hf, path, kind in _attn_mlp_entries(False, qk_norm=False):
    yield f"midlayer.{hf}", ("midlayer", *path), kind


def _get(tree: Any, path: tuple[str, ...]) -> Any:
  for p in path:
    tree = tree[p]
  return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _dtype_name(dt: np.dtype) -> str:
  if dt == np.dtype(ml_dtypes.bfloat16):
    return "bfloat16"
  return np.dtype(dt).name


def open_tensors(model_dir: str) -> TensorSource | TorchBinSource:
  """The tensors of a drafter directory: its safetensors, else a `pytorch_model.bin` (yuhuili's
  EAGLE-3 heads) read by the weights-only unpickler (`io.torch_bin`: no pickled code runs)."""
  has_safetensors = any(
    os.path.exists(os.path.join(model_dir, f)) for f in (SINGLE_FILE, INDEX_FILE)
  )
  if not has_safetensors and os.path.isfile(os.path.join(model_dir, BIN_FILE)):
    return TorchBinSource(model_dir)
  return TensorSource(model_dir)


def tensor_names(model_dir: str) -> set[str]:
  """Names of the tensors stored in a checkpoint directory, any leading 'model.' removed."""
  src = open_tensors(model_dir)
  try:
    return {n[len("model.") :] if n.startswith("model.") else n for n in src.keys()}
  finally:
    src.close()


def read_checkpoint(
  model_dir: str, entries: list[Entry], shapes: Any, extra: tuple[str, ...] = ()
) -> tuple[dict, dict[str, np.ndarray], str]:
  """Reads `entries` (checked against `shapes`) plus the raw `extra` tensors.

  Accepts names with or without a leading 'model.'; returns (params, extra tensors, dtype).
  Tensors that neither `entries` nor `extra` name raise (`check_unexpected`); so do NaN/Inf.
  """
  src = open_tensors(model_dir)
  try:
    present = src.keys()
    wanted = [hf for hf, _, _ in entries] + list(extra)
    prefix = ""
    if not any(n in present for n in wanted) and any("model." + n in present for n in wanted):
      prefix = "model."
    missing = [hf for hf, _, _ in entries if prefix + hf not in present]
    if missing:
      more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
      raise CheckpointError(
        f"checkpoint in {model_dir} lacks {len(missing)} tensor(s) the "
        f"config needs: {missing[:10]}{more}"
      )
    check_unexpected(model_dir, present, {prefix + n for n in wanted}, "this drafter layout")
    params: dict = {}
    dtypes = set()
    for hf, path, kind in entries:
      want_shape = tuple(_get(shapes, path).shape)
      got = src.shape(prefix + hf)
      if got != layouts.hf_shape(want_shape, kind):
        raise CheckpointError(
          f"tensor {hf} has shape {list(got)}, but the config implies "
          f"{list(layouts.hf_shape(want_shape, kind))}"
        )
      w = src.get(prefix + hf)
      check_finite(prefix + hf, w, src.file_of[prefix + hf])
      dtypes.add(_dtype_name(w.dtype))
      _set(params, path, np.ascontiguousarray(layouts.to_jax_layout(w, kind, want_shape)))
    raw = {n: src.get(prefix + n) for n in extra if prefix + n in present}
  finally:
    src.close()
  if len(dtypes) > 1:
    raise CheckpointError(f"checkpoint in {model_dir} mixes weight dtypes {sorted(dtypes)}")
  dtype = dtypes.pop() if dtypes else "float32"
  if dtype not in ("float32", "bfloat16", "float16"):
    raise CheckpointError(f"checkpoint in {model_dir} has unsupported weight dtype {dtype}")
  return params, raw, dtype


def export_tensors(entries: Iterator[Entry], params: Any) -> dict[str, np.ndarray]:
  """HF-named numpy tensors of a parameter tree (in the parameters' own dtype)."""
  host = jax.tree_util.tree_map(np.asarray, params)
  return {hf: np.ascontiguousarray(layouts.to_hf_layout(_get(host, path), kind)) for hf, path, kind in entries}


def write_checkpoint(out_dir: str, hf_config: dict, tensors: dict[str, np.ndarray]) -> None:
  """config.json and one model.safetensors."""
  os.makedirs(out_dir, exist_ok=True)
  for stale in (INDEX_FILE,):
    if os.path.exists(os.path.join(out_dir, stale)):
      os.remove(os.path.join(out_dir, stale))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  write_file(tensors, os.path.join(out_dir, SINGLE_FILE))


def detect_kind(hf: dict) -> str:
  """'dflash', 'eagle3', 'gemma4_assistant' or 'causal_lm' from a config.json dict."""
  archs = HFConfigReader(hf, "drafter checkpoint").strings("architectures", ())
  if DFLASH_ARCH in archs or "dflash_config" in hf:
    return "dflash"
  if GEMMA4_ASSISTANT_ARCH in archs or hf.get("model_type") == "gemma4_assistant":
    return "gemma4_assistant"
  if any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in hf:
    return "eagle3"
  return "causal_lm"


# --------------------------------------------------------------------------------------------------
# DFlash
# --------------------------------------------------------------------------------------------------


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """DFlash's default taps: `num_draft_layers` ids spread evenly over [1, L−3]."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  lo, hi = 1, num_target_layers - 3
  return tuple(
    int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)
  )



def dflash_config_from_hf(hf: dict, source: str = "config.json") -> dict[str, Any]:
  """DFlashConfig fields from a DFlash config.json (target_layer_ids None: the default).

  Every field is type-checked (ConfigError naming it, prefixed with `source`); the sizes are
  required, RoPE as `_layer_from_hf` reads it.
  """
  r = HFConfigReader(hf, f"DFlash checkpoint {source}")
  r.require("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
  dcfg = HFConfigReader(r.mapping("dflash_config"), f"{r.what}: dflash_config")
  if not dcfg.has("mask_token_id"):
    raise r.error("dflash_config.mask_token_id is missing")
  fields = _layer_from_hf(r)
  layers = r.integer("num_hidden_layers")
  num_target = r.integer("num_target_layers", 0)
  ids = dcfg.integers("target_layer_ids", None)
  if ids is None and not num_target:
    raise r.error("neither dflash_config.target_layer_ids nor num_target_layers")
  layer_types = r.strings("layer_types", None) or ("full_attention",) * layers
  if len(layer_types) != layers:
    raise r.error(f"layer_types has {len(layer_types)} entries for {layers} layers")
  window = r.integer("sliding_window", 0)
  windows = []
  for t in layer_types:
    if t == "sliding_attention":
      if window <= 0:
        raise r.error("a sliding_attention layer needs a positive sliding_window")
      windows.append(window)
    elif t == "full_attention":
      windows.append(0)
    else:
      raise r.error(f"unsupported layer type {t!r}")
  return dict(
    fields,
    num_layers=layers,
    target_layer_ids=ids,
    mask_token_id=dcfg.integer("mask_token_id"),
    block_size=r.integer("block_size", 16),
    vocab_size=r.integer("vocab_size", 0),
    draft_vocab_size=r.integer("draft_vocab_size", 0),
    num_target_layers=num_target,
    attention_bias=r.flag("attention_bias", False),
    layer_windows=tuple(windows),
  )


def _layer_from_hf(r: HFConfigReader) -> dict[str, Any]:
  """The decoder-layer fields every drafter config has (SwiGLU with SiLU; RoPE default or
  scaled as the targets' are: linear, dynamic, YaRN as Kimi's DFlash drafters state it,
  llama3 as Llama-3.1 EAGLE-3 heads do)."""
  if r.string("hidden_act", "silu") != "silu":
    raise r.error(f"hidden_act {r.hf['hidden_act']!r} is not supported (only 'silu')")
  hidden = r.integer("hidden_size")
  heads = r.integer("num_attention_heads")
  theta, _ = r.rope(10000.0, allowed=ROPE_TYPES)
  return dict(
    hidden_size=hidden,
    num_heads=heads,
    num_kv_heads=r.integer("num_key_value_heads", heads),
    head_dim=r.integer("head_dim", hidden // heads if heads > 0 else 0),
    intermediate_size=r.integer("intermediate_size"),
    rms_norm_eps=_positive(r, "rms_norm_eps", 1e-6),
    rope_theta=theta,
    rope_scaling=r.rope_scaling(r.integer("max_position_embeddings", 32768)),
  )


def _layer_to_hf(config: Any) -> dict[str, Any]:
  """The config.json keys of `_layer_from_hf`'s fields."""
  return dict(
    hidden_size=config.hidden_size,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    intermediate_size=config.intermediate_size,
    hidden_act="silu",
    rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta,
  )


def _rope_to_hf(hf: dict, config: Any) -> None:
  """Writes the drafter's RoPE into `hf` (its checkpoint's own config.json, other keys kept):
  a scaling the checkpoint did not state, and the base in `rope_parameters`."""
  if config.rope_scaling and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
    scaling = {
      k: v for k, v in config.rope_scaling if v is not None and k != "max_position_embeddings"
    }
    hf["rope_parameters"] = scaling
  if isinstance(hf.get("rope_parameters"), dict):
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": config.rope_theta}


def _positive(r: HFConfigReader, key: str, default: float) -> float:
  """A float field that must be > 0 (an RMSNorm epsilon ≤ 0 divides by zero or NaNs)."""
  v = r.number(key, default)
  if not v > 0:
    raise r.error(f"{key} must be positive, got {v}")
  return v


def dflash_config_to_hf(config: Any, base: Optional[dict] = None) -> dict:
  """The config.json of a DFlashConfig, on top of the checkpoint's own (other keys kept)."""
  hf = dict(base or {})
  windows = [w for w in config.layer_windows if w]
  if len(set(windows)) > 1:
    raise ConfigError("the DFlash config format has one sliding_window for all sliding layers")
  hf.update(
    architectures=[DFLASH_ARCH],
    model_type=hf.get("model_type", "qwen3"),
    auto_map=hf.get("auto_map", {"AutoModel": "dflash.DFlashDraftModel"}),
    block_size=config.block_size,
    dflash_config={
      **dict(hf.get("dflash_config") or {}),
      "mask_token_id": config.mask_token_id,
      "target_layer_ids": list(config.target_layer_ids),
    },
    **_layer_to_hf(config),
    num_hidden_layers=config.num_layers,
    attention_bias=config.attention_bias,
    layer_types=["sliding_attention" if w else "full_attention" for w in config.layer_windows],
    sliding_window=windows[0] if windows else None,
    use_sliding_window=bool(windows),
    tie_word_embeddings=False,
  )
  _rope_to_hf(hf, config)
  if config.vocab_size:
    hf["vocab_size"] = config.vocab_size
  if config.reduced_vocab:
    hf["draft_vocab_size"] = config.draft_vocab_size
  if config.num_target_layers:
    hf["num_target_layers"] = config.num_target_layers
  hf.setdefault("max_window_layers", config.num_layers)
  hf.setdefault("attention_dropout", 0.0)
  hf.setdefault("dtype", config.param_dtype)
  return hf


# --------------------------------------------------------------------------------------------------
# EAGLE-3
# --------------------------------------------------------------------------------------------------


def eagle3_default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's taps (as layer outputs): the inputs of layers 2, L//2 and L−3."""
  return (1, num_target_layers // 2 - 1, num_target_layers - 4)



def eagle3_config_from_hf(
  hf: dict, has_embedding: bool = False, source: str = "config.json"
) -> dict[str, Any]:
  """Eagle3Config fields from an EAGLE-3 config.json (target_layer_ids None: the default).

  Every field is type-checked (ConfigError naming it, prefixed with `source`); the sizes are
  required, RoPE as `_layer_from_hf` reads it.
  """
  r = HFConfigReader(hf, f"EAGLE-3 checkpoint {source}")
  r.require("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
  if r.integer("num_hidden_layers", 1) != 1:
    raise r.error(f"EAGLE-3 has one decoder layer, config says {hf['num_hidden_layers']}")
  if r.flag("attention_bias", False):
    raise r.error("attention biases are not part of the EAGLE-3 layout")
  fields = _layer_from_hf(r)
  vocab = r.integer("vocab_size")
  return dict(
    fields,
    target_layer_ids=_eagle3_layer_ids(r),
    vocab_size=vocab,
    draft_vocab_size=r.integer("draft_vocab_size", vocab),
    target_hidden_size=r.integer("target_hidden_size", fields["hidden_size"]),
    fc_norm=r.flag("fc_norm", False),
    norm_output=r.flag("norm_output", True),
    has_embedding=has_embedding,
  )


def _eagle3_layer_ids(r: HFConfigReader) -> Optional[tuple[int, ...]]:
  """The tapped layers as layer-output ids (HF hidden_states[id + 1]), or None: the default.

  Two conventions share one key name. `eagle_config.eagle_aux_hidden_state_layer_ids`
  (SpecForge, which trains these checkpoints, and SGLang) names layer outputs; the top-level
  `eagle_aux_hidden_state_layer_ids` (vLLM, speculators) names layer inputs, i.e. the output
  of layer id − 1 (0 would be the embedding). Both are read; they must agree.
  """
  eagle = HFConfigReader(r.mapping("eagle_config"), f"{r.what}: eagle_config")
  nested = eagle.integers(EAGLE3_IDS_KEY, None)
  inputs = r.integers(EAGLE3_IDS_KEY, None)
  if inputs is not None and min(inputs, default=1) < 1:
    raise r.error(
      f"{EAGLE3_IDS_KEY} {list(inputs)} names layer inputs (vLLM's convention), so 0 would be "
      "the embedding, which jaxspec does not tap"
    )
  outputs = None if inputs is None else tuple(i - 1 for i in inputs)
  if nested is not None and outputs is not None and nested != outputs:
    raise r.error(
      f"eagle_config.{EAGLE3_IDS_KEY} {list(nested)} (layer outputs) and the top-level "
      f"{EAGLE3_IDS_KEY} {list(inputs)} (layer inputs) name different layers"
    )
  return nested if nested is not None else outputs


def eagle3_config_to_hf(config: Any, base: Optional[dict] = None) -> dict:
  """The config.json of an Eagle3Config, on top of the checkpoint's own (other keys kept)."""
  hf = dict(base or {})
  hf.update(
    architectures=hf.get("architectures") or [EAGLE3_ARCH],
    model_type=hf.get("model_type", "llama"),
    **_layer_to_hf(config),
    num_hidden_layers=1,
    vocab_size=config.vocab_size,
    draft_vocab_size=config.draft_vocab_size,
    eagle_config={
      **dict(hf.get("eagle_config") or {}),
      EAGLE3_IDS_KEY: list(config.target_layer_ids),
    },
  )
  if EAGLE3_IDS_KEY in hf:  # vLLM's top-level key names layer inputs: one more
    hf[EAGLE3_IDS_KEY] = [i + 1 for i in config.target_layer_ids]
  if config.target_hidden_size != config.hidden_size or "target_hidden_size" in hf:
    hf["target_hidden_size"] = config.target_hidden_size
  if config.fc_norm or "fc_norm" in hf:
    hf["fc_norm"] = config.fc_norm
  if not config.norm_output or "norm_output" in hf:
    hf["norm_output"] = config.norm_output
  _rope_to_hf(hf, config)
  hf.setdefault("tie_word_embeddings", False)
  hf.setdefault("torch_dtype", config.param_dtype)
  return hf


def make_vocab_maps(used_target_ids: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(d2t [V_d] int64 offsets, t2d [V] bool) for a draft vocabulary of the given target ids."""
  ids = np.sort(np.unique(np.asarray(used_target_ids, np.int64)))
  if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
    raise ConfigError(f"draft vocabulary ids must lie in [0, {vocab_size})")
  t2d = np.zeros((vocab_size,), bool)
  t2d[ids] = True
  return ids - np.arange(ids.size, dtype=np.int64), t2d


def check_vocab_maps(
  d2t: np.ndarray, t2d: np.ndarray, vocab_size: int, draft_vocab_size: int
) -> None:
  """Raises CheckpointError unless d2t/t2d describe the same injective draft → target map."""
  d2t, t2d = np.asarray(d2t), np.asarray(t2d)
  if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
    raise CheckpointError(
      f"d2t must be [{draft_vocab_size}] and t2d [{vocab_size}], got "
      f"{list(d2t.shape)} and {list(t2d.shape)}"
    )
  target_ids = np.arange(draft_vocab_size) + d2t.astype(np.int64)
  if target_ids.min() < 0 or target_ids.max() >= vocab_size:
    raise CheckpointError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
  if len(np.unique(target_ids)) != draft_vocab_size:
    raise CheckpointError("d2t maps two draft ids to the same target id")
  if not np.array_equal(np.flatnonzero(t2d.astype(bool)), np.sort(target_ids)):
    raise CheckpointError("t2d does not mark exactly the target ids that d2t maps to")


# --------------------------------------------------------------------------------------------------
# Whole checkpoints
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DrafterCheckpoint:
  """A drafter checkpoint as read: its config (param_dtype: the weights' dtype), numpy parameter
  tree (jaxspec layout), config.json dict, and EAGLE-3's own d2t (int64) / t2d (bool) arrays
  (None without them), kept for an exact export."""

  config: Any
  params: dict
  hf_config: dict
  vocab_maps: Optional[dict] = None


# config class (built from config fields) → its parameter shapes (jax.ShapeDtypeStruct tree)
ParamShapes = Callable[[Any], Any]


def load_dflash(model_dir: str, config_cls: type, param_shapes: ParamShapes) -> DrafterCheckpoint:
  """A DFlash checkpoint (z-lab layout): config_cls(**fields) with the default taps where
  config.json names none, the tensors checked against param_shapes(config), and jaxspec's
  optional draft vocabulary (`draft_vocab_size` with d2t/t2d, as EAGLE-3 stores it) checked."""
  hf = read_config(model_dir)
  fields = dflash_config_from_hf(hf, source=os.path.join(model_dir, "config.json"))
  if fields["target_layer_ids"] is None:
    fields["target_layer_ids"] = build_target_layer_ids(
      fields["num_target_layers"], fields["num_layers"]
    )
  config = config_cls(**fields)
  params, raw, dtype = read_checkpoint(
    model_dir, list(dflash_tensor_map(config)), param_shapes(config), extra=("d2t", "t2d")
  )
  maps = _vocab_maps(model_dir, raw, config)
  return DrafterCheckpoint(config.replace(param_dtype=dtype), params, hf, maps)


def _vocab_maps(model_dir: str, raw: dict, config: Any) -> Optional[dict]:
  """The checkpoint's d2t/t2d arrays, checked (required with a reduced draft vocabulary)."""
  d2t, t2d = raw.get("d2t"), raw.get("t2d")
  if config.reduced_vocab and (d2t is None or t2d is None):
    raise CheckpointError(
      f"checkpoint in {model_dir} has a reduced draft vocabulary "
      f"({config.draft_vocab_size} < {config.vocab_size}) but lacks d2t/t2d"
    )
  if d2t is None and t2d is None:
    return None
  if d2t is None or t2d is None:
    raise CheckpointError(f"checkpoint in {model_dir} has only one of d2t and t2d")
  try:
    check_vocab_maps(d2t, t2d, config.vocab_size, config.draft_vocab_size)
  except ValueError as e:
    raise CheckpointError(f"checkpoint in {model_dir}: {e}") from None
  return {"d2t": np.asarray(d2t), "t2d": np.asarray(t2d)}


def vocab_map_tensors(config: Any, d2t: Any) -> dict[str, np.ndarray]:
  """d2t (int64 offsets) and t2d (bool) of a reduced draft vocabulary; {} without one."""
  if not config.reduced_vocab:
    return {}
  out = {"d2t": np.asarray(d2t).astype(np.int64), "t2d": np.zeros((config.vocab_size,), bool)}
  out["t2d"][np.arange(out["d2t"].shape[0]) + out["d2t"]] = True
  return out


def dflash_tensors(config: Any, params: Any, d2t: Any = None) -> dict[str, np.ndarray]:
  """A DFlash drafter's weights (its "draft" parameters) under their published names, and
  d2t/t2d with a draft vocabulary."""
  return {**export_tensors(dflash_tensor_map(config), params), **vocab_map_tensors(config, d2t)}


def save_dflash(
  out_dir: str, config: Any, params: Any, hf_config: Optional[dict] = None, d2t: Any = None
) -> None:
  """Writes config.json (on top of `hf_config`, the loaded one) and model.safetensors."""
  tensors = dflash_tensors(config, params, d2t)
  write_checkpoint(out_dir, dflash_config_to_hf(config, hf_config), tensors)


def load_eagle3(
  model_dir: str, config_cls: type, param_shapes: ParamShapes, num_target_layers: int
) -> DrafterCheckpoint:
  """An EAGLE-3 checkpoint (SafeAILab / SpecForge layout): config_cls(**fields), the taps
  defaulting to the inputs of layers 2, L//2 and L−3 of a target of `num_target_layers`
  unless config.json names them; the tensors checked against param_shapes(config), and the
  d2t/t2d maps checked (required with a reduced draft vocabulary)."""
  hf = read_config(model_dir)
  fields = eagle3_config_from_hf(
    hf,
    has_embedding="embed_tokens.weight" in tensor_names(model_dir),
    source=os.path.join(model_dir, "config.json"),
  )
  if fields["target_layer_ids"] is None:
    fields["target_layer_ids"] = eagle3_default_layer_ids(num_target_layers)
  config = config_cls(**fields)
  params, raw, dtype = read_checkpoint(
    model_dir, list(eagle3_tensor_map(config)), param_shapes(config), extra=("d2t", "t2d")
  )
  maps = _vocab_maps(model_dir, raw, config)
  return DrafterCheckpoint(config.replace(param_dtype=dtype), params, hf, maps)


def eagle3_tensors(
  config: Any, params: Any, d2t: Any = None, vocab_maps: Optional[dict] = None
) -> dict[str, np.ndarray]:
  """An EAGLE-3 drafter's weights (its "draft" parameters) and d2t/t2d under their published
  names: the checkpoint's own maps when given, else built from the d2t offsets."""
  out = export_tensors(eagle3_tensor_map(config), params)
  out.update(vocab_maps or vocab_map_tensors(config, d2t))
  return out


def save_eagle3(
  out_dir: str,
  config: Any,
  params: Any,
  d2t: Any = None,
  vocab_maps: Optional[dict] = None,
  hf_config: Optional[dict] = None,
) -> None:
  """Writes config.json (on top of `hf_config`) and model.safetensors in the SpecForge layout."""
  tensors = eagle3_tensors(config, params, d2t, vocab_maps)
  write_checkpoint(out_dir, eagle3_config_to_hf(config, hf_config), tensors)
