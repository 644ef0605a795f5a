"""Hugging Face checkpoints: `config.json` + (sharded) `*.safetensors` ↔ jaxspec parameters.

Reads a target's config and weights and writes them back, under the names of the tensor map
(`jaxspec.io.tensor_map`) from the files of `jaxspec.io.safetensors_files`. Every tensor the
architecture needs must be present with the right shape and finite values; a tensor it does not
use is an error too (the checkpoint is not the model the config describes), except the few
redundant ones published layouts carry, which are skipped with a warning. Everything is checked
once, as it is read, and named: never a silent fallback to random weights, never a raw KeyError
or JSONDecodeError. Files that are absent, unreadable or not valid JSON / safetensors raise
CheckpointError; valid JSON with bad contents raises ConfigError (for config.json) or
CheckpointError (for the shard index); both name the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Collection
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.options import RunOptions
from jaxspec.io import architectures, compressed_tensors, gguf, hub, layouts
from jaxspec.io import quantized as quantized_io
from jaxspec.io.safetensors_files import (
  INDEX_FILE,
  SINGLE_FILE,
  TensorSource,
  check_finite,
  check_unexpected,
  read_json,
  text_name,
  write_file,
)
from jaxspec.io.tensor_map import mtp_copies, mtp_prefix, tensor_layout, tensor_map
from jaxspec.models import decoder as decoder_lib
from jaxspec.models import target as target_lib
from jaxspec.quant.formats import QTensor
from jaxspec.quant.policy import contraction_axes

MAX_SHARD_BYTES = 2 * 1024**3
_LOG = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


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
  hf = read_json(path)
  if not isinstance(hf, dict):
    raise ConfigError(f"{path} must hold a JSON object, got a JSON {type(hf).__name__}")
  return hf


def load_config(model_dir: str, **overrides: Any) -> tuple[ModelConfig, dict]:
  """(ModelConfig, config.json dict) of a checkpoint directory; a ConfigError names the file."""
  return _config(read_config(model_dir), os.path.join(model_dir, "config.json"), overrides)


def _config(hf_config: dict, path: str, overrides: dict) -> tuple[ModelConfig, dict]:
  try:
    return architectures.config_from_hf(hf_config, **overrides), hf_config
  except ConfigError as e:
    given = f" (with overrides {', '.join(sorted(overrides))})" if overrides else ""
    raise ConfigError(f"{path}{given}: {e}") from None


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


def _layer_index(name: str) -> int | None:
  m = re.match(r"model\.layers\.(\d+)\.", name)
  return int(m.group(1)) if m else None


def differing_mtp_copies(src: TensorSource, copies: dict[str, str]) -> list[str]:
  """The MTP layers' published embedding / head copies (`tensor_map.mtp_copies`) present in
  `src` that differ from the main tensor they copy (in shape, dtype or any value)."""
  main: dict[str, np.ndarray] = {}
  out = []
  for name, of in copies.items():
    if name not in src.file_of or of not in src.file_of:
      continue
    if of not in main:
      main[of] = src.get(of)
    copy = src.get(name)
    if copy.dtype != main[of].dtype or not np.array_equal(copy, main[of]):
      out.append(name)
  return out


def load_params(
  model_dir: str,
  config: ModelConfig,
  *,
  extra_layers_ok: bool = False,
  quantization: dict | None = None,
  source: Any = None,
  equal_mtp_copies: Collection[str] | None = None,
) -> Any:
  """Reads the parameters of `config` from a HF checkpoint directory (numpy, param_dtype).

  `source`: the tensors under their HF names when they are not `model_dir`'s safetensors
  files (a GGUF file's: `jaxspec.io.gguf.GGUFTensorSource`).

  Each tensor is checked as it is read: present, of the config's shape, finite once cast to
  param_dtype. Tensors the config does not use raise (`check_unexpected`), except a tied
  `lm_head.weight` (transformers ignores it too), the MTP tensors transformers does not build
  (the family's `TensorLayout.unbuilt_mtp`: Qwen3.5's `mtp.*` module, MiMo's `model.mtp.*`)
  when the config has no MTP layer (undeclared, or `num_mtp_layers=0` asked for), a KV-shared
  layer's K/V and, with `extra_layers_ok` (the caller asked for fewer layers than stored), the
  layers past the ones loaded: those warn.

  The MTP layers' published embedding / head (`tensor_map.mtp_copies`) that `config` shares
  with the main model are skipped when equal to the main tensors (compared here, unless the
  caller already found `equal_mtp_copies` equal); one that differs raises, since sharing it
  would draft with the wrong weights (`load_model` gives such layers their own instead).
  """
  depth = config.num_layers + config.num_mtp_layers
  copies = mtp_copies(config)

  def ignorable(name: str) -> bool:
    if config.tie_word_embeddings and name == "lm_head.weight":
      return True
    if unbuilt and not config.num_mtp_layers and name.startswith(unbuilt):
      return True  # MTP layers the config leaves out (num_mtp_layers=0): transformers' skip
    if shared_kv(name):
      return True  # Gemma 4: K/V of KV-shared layers, which read another layer's
    i = _layer_index(name)
    return extra_layers_ok and i is not None and i >= depth

  unbuilt = tensor_layout(config).unbuilt_mtp
  shared_kv = kv_shared_ignorable(config)

  src = source if source is not None else TensorSource(model_dir)
  stacked = config.with_options(scan_layers=True)  # read stacked
  shapes = target_lib.param_shapes(stacked)
  axes_tree = target_lib.logical_axes(stacked)
  dtype = (
    np.dtype(ml_dtypes.bfloat16)
    if config.param_dtype == "bfloat16"
    else np.dtype(config.param_dtype)
  )
  params: dict = {}
  unchecked = {n: of for n, of in copies.items() if n not in (equal_mtp_copies or ())}
  differing = differing_mtp_copies(src, unchecked)
  if differing:
    src.close()
    raise CheckpointError(
      f"checkpoint in {model_dir}: MTP tensor(s) {differing} differ from the main model's "
      f"({sorted({copies[n] for n in differing})}), which this config shares with its MTP "
      f"layers; load it with load_model (it gives such layers their own) or set "
      f"mtp_own_embed / mtp_own_head"
    )
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
    expected += list(copies)  # shared with the main tensors, found equal above
    check_unexpected(model_dir, src.keys(), expected, "the config", ignorable)
    stacks: dict = {}
    for hf, path, layer_idx, kind in needed:
      expert = None
      if path[-1].startswith("#"):
        expert, path = int(path[-1][1:]), path[:-1]
      full = _get_path(shapes, path)
      per_layer = full.shape[1:] if layer_idx is not None else full.shape
      per_item = per_layer[1:] if expert is not None else per_layer
      if hf in quantized and quantized[hf][0] in _PER_WEIGHT:  # stored per weight and expert
        if quantized[hf][0] == "fp8_block":
          block = tuple(int(b) for b in quantization["weight_block_size"])
          q = quantized_io.import_fp8_block(
            src, hf, kind, tuple(per_item), block, config.param_dtype
          )
        else:
          axes = contraction_axes(_get_path(axes_tree, path))
          q = compressed_tensors.import_weight(
            src, hf, quantized[hf][2], kind, tuple(per_item), axes, config.param_dtype
          )
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


# Formats stored one tensor set per weight and per expert (stacked as they are read).
_PER_WEIGHT = ("fp8_block", compressed_tensors.METHOD)


def _quantized_entries(quantization: dict | None, src: "TensorSource", needed: list) -> dict:
  """{hf name: (format, stored names, base)} of the weights a quantized checkpoint holds
  quantized, by its quantization_config (jaxspec's own, gpt-oss MXFP4, block FP8; for
  compressed-tensors the base is the weight's config group, `compressed_tensors.entries`)."""
  method = (quantization or {}).get("quant_method")
  if method is None:
    return {}
  names, out = src.keys(), {}
  if method == compressed_tensors.METHOD:
    return compressed_tensors.entries(quantization, src, needed)
  if method == "fp8" and quantization.get("weight_block_size"):
    for hf, *_ in needed:
      if f"{hf}_scale_inv" in names:
        out[hf] = ("fp8_block", (hf, f"{hf}_scale_inv"), hf)
    return out
  if method not in (quantized_io.QUANT_METHOD, quantized_io.HF_MXFP4_METHOD):
    raise CheckpointError(
      f"quantization_config quant_method {method!r} is not supported (jaxspec reads its own "
      f"{quantized_io.QUANT_METHOD!r} checkpoints, gpt-oss's 'mxfp4' ones, block-scaled "
      f"'fp8' ones and {compressed_tensors.METHOD!r} INT4 / FP8 ones)"
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
  no MTP modules); of a Qwen3.5 / Qwen3-Next, `mtp_num_hidden_layers` and no `mtp.*`. Such a
  checkpoint is a complete target: it loads with a warning and `num_mtp_layers = 0`. A
  checkpoint holding some but not all MTP tensors is left alone, so that `load_params` names
  the missing ones.
  """
  src = TensorSource(model_dir, quiet=True)
  names = src.keys()
  src.close()
  prefixes = tuple(mtp_prefix(config, k) for k in range(config.num_mtp_layers))
  if any(name.startswith(prefixes) for name in names):
    return config, hf_config
  key = architectures.ARCHITECTURES[config.architecture].mtp_key
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


def _mtp_embeddings(model_dir: str, config: ModelConfig) -> tuple[ModelConfig, list[str]]:
  """Shares or keeps the MTP layers' published embedding and LM head.

  DeepSeek-V3 / V3.1 / V3.2 / R1 and GLM-4.5-4.7 publish `embed_tokens.weight` and
  `shared_head.head.weight` in each MTP layer. A copy equal to the main model's tensor is
  shared (read once, held once); if any layer's copy differs, the MTP layers read their own
  (`mtp_own_embed` / `mtp_own_head`), as vLLM's MTP model loads them. Returns the config and
  the copies found equal; the choice is logged.
  """
  copies = mtp_copies(config)
  if not copies:
    return config, []
  src = TensorSource(model_dir, quiet=True)
  try:
    differing = differing_mtp_copies(src, copies)
    present = [n for n in copies if n in src.file_of]
  finally:
    src.close()
  layout = tensor_layout(config)
  own_embed = config.mtp_own_embed or any(n.endswith(layout.mtp_embed) for n in differing)
  own_head = config.mtp_own_head or any(n.endswith(layout.mtp_head) for n in differing)
  if (own_embed, own_head) != (config.mtp_own_embed, config.mtp_own_head):
    config = config.replace(mtp_own_embed=own_embed, mtp_own_head=own_head)
  equal = [n for n in present if n not in differing]
  if present:
    what = lambda own: "its own (the published copy differs)" if own else "the main model's"
    _LOG.info(
      "%s: the MTP layers read %s embedding and %s LM head",
      model_dir,
      what(own_embed),
      what(own_head),
    )
  return config, equal


def load_model(
  model_dir: str,
  scan_layers: bool = False,
  options: RunOptions | None = None,
  **config_overrides: Any,
) -> target_lib.TargetModel:
  """Loads config.json, the safetensors weights and the tokenizer (when present: tokenizer.json
  or Kimi's tiktoken.model, with the chat template).

  `model_dir` is a checkpoint directory, a GGUF file (`jaxspec.io.gguf`: config, weights and
  tokenizer from the one file) or a hub id (`org/name`, `org/name/file.gguf`: resolved through
  huggingface_hub's cache, `jaxspec.io.hub`); a local path of that name wins.

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
  required, as are the rest of a partially present MTP layer set. The embedding and LM head
  that DeepSeek / GLM MTP layers publish are shared with the main ones when equal, else the
  layers keep their own (`_mtp_embeddings`; logged at INFO), so a published checkpoint keeps
  its MTP drafter.
  """
  model_dir = hub.resolve(model_dir)
  if options is not None:
    config_overrides["options"] = options
  if gguf.is_gguf(model_dir) and os.path.isfile(model_dir):
    return _load_gguf(model_dir, scan_layers, config_overrides)
  if not os.path.isdir(model_dir):
    raise CheckpointError(f"model directory {model_dir!r} does not exist")
  config, hf_config = load_config(model_dir, **config_overrides)
  config = config.with_options(scan_layers=scan_layers)
  if config.num_mtp_layers and "num_mtp_layers" not in config_overrides:
    config, hf_config = _without_absent_mtp_layers(model_dir, config, hf_config)
  config, equal_copies = _mtp_embeddings(model_dir, config)
  fewer_layers = bool({"num_layers", "num_mtp_layers"} & set(config_overrides))
  params = load_params(
    model_dir,
    config,
    extra_layers_ok=fewer_layers,
    quantization=architectures.text_config(hf_config).get("quantization_config"),
    equal_mtp_copies=equal_copies,
  )
  params = jax.tree_util.tree_map(jnp.asarray, params)
  from jaxspec.io import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

  tokenizer = None
  if tokenizer_lib.has_tokenizer(model_dir):  # tokenizer.json, or Kimi's tiktoken.model
    tokenizer = tokenizer_lib.Tokenizer.from_dir(model_dir)
  return target_lib.TargetModel(config, params, tokenizer, hf_config)


def _load_gguf(path: str, scan_layers: bool, config_overrides: dict) -> target_lib.TargetModel:
  """`load_model` of a GGUF file: its config, dequantized weights and tokenizer."""
  ckpt = gguf.GGUFCheckpoint(path)
  config, hf_config = _config(ckpt.hf_config, path, config_overrides)
  config = config.with_options(scan_layers=scan_layers)
  fewer_layers = bool({"num_layers", "num_mtp_layers"} & set(config_overrides))
  params = load_params(path, config, extra_layers_ok=fewer_layers, source=ckpt.tensor_source())
  params = jax.tree_util.tree_map(jnp.asarray, params)
  return target_lib.TargetModel(config, params, ckpt.tokenizer(), hf_config)


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
      if w.format in ("fp8_block", "int4"):  # one tensor set per weight and expert
        if expert is not None:
          w = w.replace(values=w.values[expert], scales=w.scales[expert])
        if w.format == "int4":  # compressed-tensors' pack-quantized layout
          out.update(compressed_tensors.export_weight(w, hf, kind))
        else:
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
  # The MTP layers' copies of the main embedding / head, written as DeepSeek and GLM publish
  # them (vLLM and SGLang read an MTP layer's embedding from its own tensor).
  for name, of in mtp_copies(config).items():
    if of in out:
      out[name] = out[of]
  return out


def save_hf(
  model: target_lib.TargetModel, out_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
  """Writes config.json, model.safetensors (sharded with an index when large) and tokenizer.

  The model of a multimodal checkpoint is written as its text model (the config.json of its
  `text_config`), since only that is built."""
  os.makedirs(out_dir, exist_ok=True)
  hf_config = dict(architectures.text_config(model.hf_config or {}))
  hf_config.update(architectures.config_to_hf(model.config))
  is_q = lambda x: isinstance(x, QTensor)
  tensors = export_tensors(model.config, model.params)
  leaves = jax.tree_util.tree_leaves(model.params, is_leaf=is_q)
  used = sorted({x.format for x in leaves if is_q(x)})
  if "fp8_block" in used:  # an imported block-scaled FP8 checkpoint: its own config
    if used != ["fp8_block"]:
      raise ConfigError(f"cannot save block-scaled FP8 weights beside {used} in one checkpoint")
  elif "int4" in used:  # compressed-tensors pack-quantized, as Kimi-K2 publishes
    groups = sorted({x.layout[0] for x in leaves if is_q(x) and x.format == "int4"})
    if used != ["int4"] or len(groups) > 1:
      raise ConfigError(
        f"cannot save int4 weights beside {used} (groups {groups}) in one checkpoint"
      )
    modules = [n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")]
    hf_config["quantization_config"] = compressed_tensors.export_config(modules, groups[0])
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
    write_file(shards[0], os.path.join(out_dir, SINGLE_FILE))
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      write_file(shard, os.path.join(out_dir, fname))
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
