"""Published drafter checkpoints: DFlash (z-lab) and EAGLE-3 (SafeAILab / SpecForge) layouts.

DFlash (`DFlashDraftModel`): config.json is a Qwen3 config plus `block_size`,
`dflash_config.{mask_token_id, target_layer_ids}`, `num_target_layers` and optional
`layer_types` / `sliding_window`; tensors are named as the PyTorch module's state dict:
`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.input_layernorm.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj.weight`
(+ `.bias` with attention_bias), `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`. No embedding or LM head: the target's are shared.

EAGLE-3 (`LlamaForCausalLMEagle3`): a Llama config with `draft_vocab_size`, optional
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc.weight`,
`midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t` (int64) and `t2d` (bool) for a reduced vocabulary,
optionally `embed_tokens.weight` and SpecForge's `fc_norm.{0,1,2}.weight`.

Loading checks every tensor's presence and shape and rejects unknown ones; export writes the
same layout back, in the dtype the weights were loaded in, so import → export is exact.

This module maps layouts only (config dicts ↔ config fields, HF tensors ↔ parameter trees); it
imports no drafter. `jaxspec.drafters.dflash.load_dflash` / `save_dflash` and their EAGLE-3
counterparts bind the results to drafters, and `jaxspec.load_drafter` / `save_drafter` dispatch.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

import jax
import ml_dtypes
import numpy as np

from jaxspec.config import ConfigError
from jaxspec.io.hf import INDEX_FILE, SINGLE_FILE, CheckpointError, _save_file, _TensorSource

DFLASH_ARCH = "DFlashDraftModel"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (hf suffix, param path, kind); kinds as in jaxspec.io.hf:
#   same: identical; linear: HF [out, in] ↔ [in, out]; in_heads: HF [heads·D, in] ↔ [in, heads, D];
#   out_heads: HF [H, heads·D] ↔ [heads, D, H]; bias_heads: HF [heads·D] ↔ [heads, D].
Entry = tuple[str, tuple[str, ...], str]


def _to_jax(w: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
  if kind == "same":
    return w
  if kind == "linear":
    return w.T
  if kind in ("in_heads", "out_heads"):
    return w.T.reshape(shape)
  if kind == "bias_heads":
    return w.reshape(shape)
  raise AssertionError(kind)


def _to_hf(w: np.ndarray, kind: str) -> np.ndarray:
  if kind == "same":
    return w
  if kind == "linear":
    return w.T
  if kind == "in_heads":
    return w.reshape(w.shape[0], -1).T
  if kind == "out_heads":
    return w.reshape(-1, w.shape[-1]).T
  if kind == "bias_heads":
    return w.reshape(-1)
  raise AssertionError(kind)


def _hf_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
  return tuple(_to_hf(np.empty(shape, np.uint8), kind).shape)


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


def tensor_names(model_dir: str) -> set[str]:
  """Names of the tensors stored in a checkpoint directory, any leading 'model.' removed."""
  src = _TensorSource(model_dir)
  try:
    return {n[len("model.") :] if n.startswith("model.") else n for n in src.keys()}
  finally:
    src.close()


def read_checkpoint(
  model_dir: str, entries: list[Entry], shapes: Any, extra: tuple[str, ...] = ()
) -> tuple[dict, dict[str, np.ndarray], str]:
  """Reads `entries` (checked against `shapes`) plus the raw `extra` tensors.

  Accepts names with or without a leading 'model.'; returns (params, extra tensors, dtype).
  """
  src = _TensorSource(model_dir)
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
    known = {prefix + n for n in wanted}
    unknown = sorted(n for n in present - known if not n.endswith(IGNORED_SUFFIXES))
    if unknown:
      raise CheckpointError(
        f"checkpoint in {model_dir} has tensor(s) this drafter layout does "
        f"not use (a different architecture or config?): {unknown[:10]}"
      )
    params: dict = {}
    dtypes = set()
    for hf, path, kind in entries:
      want_shape = tuple(_get(shapes, path).shape)
      got = src.shape(prefix + hf)
      if got != _hf_shape(want_shape, kind):
        raise CheckpointError(
          f"tensor {hf} has shape {list(got)}, but the config implies "
          f"{list(_hf_shape(want_shape, kind))}"
        )
      w = src.get(prefix + hf)
      dtypes.add(_dtype_name(w.dtype))
      _set(params, path, np.ascontiguousarray(_to_jax(w, kind, want_shape)))
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
  return {hf: np.ascontiguousarray(_to_hf(_get(host, path), kind)) for hf, path, kind in entries}


def write_checkpoint(out_dir: str, hf_config: dict, tensors: dict[str, np.ndarray]) -> None:
  """config.json and one model.safetensors."""
  os.makedirs(out_dir, exist_ok=True)
  for stale in (INDEX_FILE,):
    if os.path.exists(os.path.join(out_dir, stale)):
      os.remove(os.path.join(out_dir, stale))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  _save_file(tensors, os.path.join(out_dir, SINGLE_FILE))


def _get_key(hf: dict, key: str, default: Any = None) -> Any:
  return hf[key] if hf.get(key) is not None else default


def _rope_theta(hf: dict, what: str, default: float) -> float:
  rope = dict(_get_key(hf, "rope_parameters", None) or _get_key(hf, "rope_scaling", None) or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", None):
    raise ConfigError(f"{what}: RoPE type {rope_type!r} is not supported (only 'default')")
  return float(rope.get("rope_theta", _get_key(hf, "rope_theta", default)))


def detect_kind(hf: dict) -> str:
  """'dflash', 'eagle3' or 'causal_lm' from a config.json dict."""
  archs = hf.get("architectures") or []
  if DFLASH_ARCH in archs or "dflash_config" in hf:
    return "dflash"
  if any("eagle3" in a.lower() for a in archs) or "draft_vocab_size" in hf:
    return "eagle3"
  return "causal_lm"


# --------------------------------------------------------------------------------------------------
# DFlash
# --------------------------------------------------------------------------------------------------


def dflash_config_from_hf(hf: dict) -> dict[str, Any]:
  """DFlashConfig fields from a DFlash config.json (target_layer_ids None: the default)."""
  what = "DFlash checkpoint"
  dcfg = dict(_get_key(hf, "dflash_config", {}) or {})
  if "mask_token_id" not in dcfg or dcfg["mask_token_id"] is None:
    raise ConfigError(f"{what}: config.json lacks dflash_config.mask_token_id")
  if _get_key(hf, "hidden_act", "silu") != "silu":
    raise ConfigError(f"{what}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
  hidden = int(hf["hidden_size"])
  heads = int(hf["num_attention_heads"])
  layers = int(hf["num_hidden_layers"])
  num_target = int(_get_key(hf, "num_target_layers", 0))
  ids = dcfg.get("target_layer_ids")
  if ids is None and not num_target:
    raise ConfigError(f"{what}: neither dflash_config.target_layer_ids nor num_target_layers")
  layer_types = _get_key(hf, "layer_types", None) or ["full_attention"] * layers
  if len(layer_types) != layers:
    raise ConfigError(f"{what}: layer_types has {len(layer_types)} entries for {layers} layers")
  window = int(_get_key(hf, "sliding_window", 0) or 0)
  windows = []
  for t in layer_types:
    if t == "sliding_attention":
      if not window:
        raise ConfigError(f"{what}: a sliding_attention layer needs sliding_window")
      windows.append(window)
    elif t == "full_attention":
      windows.append(0)
    else:
      raise ConfigError(f"{what}: unsupported layer type {t!r}")
  return dict(
    hidden_size=hidden,
    num_layers=layers,
    num_heads=heads,
    num_kv_heads=int(_get_key(hf, "num_key_value_heads", heads)),
    head_dim=int(_get_key(hf, "head_dim", hidden // heads)),
    intermediate_size=int(hf["intermediate_size"]),
    target_layer_ids=None if ids is None else tuple(ids),
    mask_token_id=int(dcfg["mask_token_id"]),
    block_size=int(_get_key(hf, "block_size", 16)),
    vocab_size=int(_get_key(hf, "vocab_size", 0)),
    num_target_layers=num_target,
    rms_norm_eps=float(_get_key(hf, "rms_norm_eps", 1e-6)),
    rope_theta=_rope_theta(hf, what, 10000.0),
    attention_bias=bool(_get_key(hf, "attention_bias", False)),
    layer_windows=tuple(windows),
  )


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
    hidden_size=config.hidden_size,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    intermediate_size=config.intermediate_size,
    hidden_act="silu",
    attention_bias=config.attention_bias,
    rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta,
    layer_types=["sliding_attention" if w else "full_attention" for w in config.layer_windows],
    sliding_window=windows[0] if windows else None,
    use_sliding_window=bool(windows),
    tie_word_embeddings=False,
  )
  if "rope_parameters" in hf:
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": config.rope_theta}
  if config.vocab_size:
    hf["vocab_size"] = config.vocab_size
  if config.num_target_layers:
    hf["num_target_layers"] = config.num_target_layers
  hf.setdefault("max_window_layers", config.num_layers)
  hf.setdefault("attention_dropout", 0.0)
  hf.setdefault("dtype", config.param_dtype)
  return hf


# --------------------------------------------------------------------------------------------------
# EAGLE-3
# --------------------------------------------------------------------------------------------------


def eagle3_config_from_hf(hf: dict, has_embedding: bool = False) -> dict[str, Any]:
  """Eagle3Config fields from an EAGLE-3 config.json (target_layer_ids None: the default)."""
  what = "EAGLE-3 checkpoint"
  if int(_get_key(hf, "num_hidden_layers", 1)) != 1:
    raise ConfigError(
      f"{what}: EAGLE-3 has one decoder layer, config says {hf['num_hidden_layers']}"
    )
  if _get_key(hf, "hidden_act", "silu") != "silu":
    raise ConfigError(f"{what}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
  if _get_key(hf, "attention_bias", False):
    raise ConfigError(f"{what}: attention biases are not part of the EAGLE-3 layout")
  hidden = int(hf["hidden_size"])
  heads = int(hf["num_attention_heads"])
  eagle = dict(_get_key(hf, "eagle_config", {}) or {})
  ids = eagle.get("eagle_aux_hidden_state_layer_ids")
  vocab = int(hf["vocab_size"])
  return dict(
    hidden_size=hidden,
    num_heads=heads,
    num_kv_heads=int(_get_key(hf, "num_key_value_heads", heads)),
    head_dim=int(_get_key(hf, "head_dim", hidden // heads)),
    intermediate_size=int(hf["intermediate_size"]),
    target_layer_ids=None if ids is None else tuple(ids),
    vocab_size=vocab,
    draft_vocab_size=int(_get_key(hf, "draft_vocab_size", vocab)),
    target_hidden_size=int(_get_key(hf, "target_hidden_size", hidden)),
    rms_norm_eps=float(_get_key(hf, "rms_norm_eps", 1e-6)),
    rope_theta=_rope_theta(hf, what, 10000.0),
    fc_norm=bool(_get_key(hf, "fc_norm", False)),
    norm_output=bool(_get_key(hf, "norm_output", True)),
    has_embedding=has_embedding,
  )


def eagle3_config_to_hf(config: Any, base: Optional[dict] = None) -> dict:
  """The config.json of an Eagle3Config, on top of the checkpoint's own (other keys kept)."""
  hf = dict(base or {})
  hf.update(
    architectures=hf.get("architectures") or [EAGLE3_ARCH],
    model_type=hf.get("model_type", "llama"),
    hidden_size=config.hidden_size,
    num_hidden_layers=1,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    intermediate_size=config.intermediate_size,
    hidden_act="silu",
    rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta,
    vocab_size=config.vocab_size,
    draft_vocab_size=config.draft_vocab_size,
    eagle_config={
      **dict(hf.get("eagle_config") or {}),
      "eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids),
    },
  )
  if config.target_hidden_size != config.hidden_size or "target_hidden_size" in hf:
    hf["target_hidden_size"] = config.target_hidden_size
  if config.fc_norm or "fc_norm" in hf:
    hf["fc_norm"] = config.fc_norm
  if not config.norm_output or "norm_output" in hf:
    hf["norm_output"] = config.norm_output
  if "rope_parameters" in hf:
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": config.rope_theta}
  hf.setdefault("tie_word_embeddings", False)
  hf.setdefault("torch_dtype", config.param_dtype)
  return hf
