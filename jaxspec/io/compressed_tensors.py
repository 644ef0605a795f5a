"""compressed-tensors checkpoints (llm-compressor's format, read by vLLM): INT4 and FP8 weights.

config.json (or, for a multimodal wrapper such as Kimi-K2.5, its `text_config`) says
`quantization_config.quant_method: "compressed-tensors"`; its `config_groups` each name
`targets` (a module class, "Linear", or "re:"-prefixed regexes / exact module names) and the
`weights` scheme, and `ignore` lists the modules kept in float (exact names or "re:" regexes
matched from the start of the name, as compressed-tensors matches them). Read here:

* `pack-quantized`, 4-bit symmetric integers, strategy "group" (or "channel": one group per
  row): `<module>.weight_packed` int32 [out, ceil(in / 8)] (value 8k + i in bits 4i..4i+3 of
  word k, stored as q + 8), `<module>.weight_scale` [out, ceil(in / G)], `<module>.weight_shape`
  [2] = [out, in]. Kept packed as jaxspec's "int4" format (the words' bytes, little-endian).
  Kimi-K2-Thinking / K2.5 store their routed experts so (G = 32).
* `float-quantized` FP8 E4M3, strategy "channel" (`weight_scale` [out, 1]) or "tensor" (one
  scale, broadcast to every output channel): `<module>.weight` F8_E4M3 [out, in], read into
  jaxspec's per-channel "fp8" format. GLM-4.5-FP8 and RedHat's FP8 checkpoints store so.

Weight-only: a declared `input_activations` scheme is not applied, activations stay in the
compute dtype (so results match the checkpoint's weights run in float, not an FP8 W8A8
runtime's rounding of activations). Dynamic activation schemes carry no tensors and load so;
static ones (`input_scale` tensors calibrated for the publisher's runtime) are refused, as are
output activation and KV-cache schemes, sparsity and transforms, other bit widths, asymmetric
(zero-point) schemes, activation reordering and other formats: each by name.

Which module is "Linear": a matrix jaxspec multiplies by (a Dense kernel or a routed expert's
projection, lm_head included); embeddings, norms and MoE routers are not (transformers'
DeepSeek/GLM routers are not nn.Linear modules). A module a target matches and `ignore` does
not must be stored quantized and every other one in float: a checkpoint that disagrees with its
config is refused, naming the module.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.io import layouts, quantized
from jaxspec.quant.formats import QTensor

METHOD = "compressed-tensors"
PACKED = "pack-quantized"
FLOAT = "float-quantized"
_LINEAR_KINDS = ("linear", "in_heads", "out_heads")
_INT4_STRATEGIES = ("group", "channel")
_FP8_STRATEGIES = ("channel", "tensor")


@dataclasses.dataclass(frozen=True)
class Scheme:
  """One config group: its targets and how its weights are stored."""

  name: str
  format: str  # PACKED or FLOAT
  targets: tuple[str, ...]
  strategy: str
  group: int | None = None  # PACKED "group"

  @property
  def stored(self) -> tuple[str, ...]:
    """Tensor-name suffixes of one quantized module."""
    if self.format == PACKED:
      return ("weight_packed", "weight_scale", "weight_shape")
    return ("weight", "weight_scale")


@dataclasses.dataclass(frozen=True)
class CTConfig:
  schemes: tuple[Scheme, ...]
  ignore: tuple[str, ...]


def _refuse(key: str, value: Any, why: str) -> ConfigError:
  return ConfigError(f"compressed-tensors quantization_config {key} = {value!r}: {why}")


def _scheme(name: str, group: Any, top_format: Any) -> Scheme:
  if not isinstance(group, dict):
    raise _refuse(f"config_groups.{name}", group, "must be an object")
  fmt = group.get("format") or top_format
  targets = group.get("targets")
  if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
    raise _refuse(f"config_groups.{name}.targets", targets, "must be a list of names")
  for key in ("output_activations",):
    if group.get(key) is not None:
      raise _refuse(f"config_groups.{name}.{key}", group[key], "not supported (weight-only)")
  act = group.get("input_activations")
  if act is not None and not (isinstance(act, dict) and act.get("dynamic") is True):
    raise _refuse(
      f"config_groups.{name}.input_activations",
      act,
      "static activation scales are calibrated for an activation-quantizing runtime; jaxspec "
      "runs weight-only (dynamic schemes load, their activations staying in float)",
    )
  w = group.get("weights")
  if not isinstance(w, dict):
    raise _refuse(f"config_groups.{name}.weights", w, "must be an object")
  key = f"config_groups.{name}.weights"
  if w.get("symmetric") is not True:
    raise _refuse(f"{key}.symmetric", w.get("symmetric"), "only symmetric schemes are read")
  if w.get("actorder") not in (None, False):
    raise _refuse(f"{key}.actorder", w.get("actorder"), "activation reordering is not read")
  if w.get("dynamic") not in (None, False):
    raise _refuse(f"{key}.dynamic", w.get("dynamic"), "weights must be stored quantized")
  bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
  if fmt == PACKED:
    if bits != 4 or kind != "int":
      raise _refuse(f"{key}.num_bits/type", (bits, kind), "pack-quantized reads 4-bit int")
    if strategy not in _INT4_STRATEGIES:
      raise _refuse(f"{key}.strategy", strategy, f"expected one of {_INT4_STRATEGIES}")
    size = w.get("group_size")
    if strategy == "group" and not (isinstance(size, int) and size > 0):
      raise _refuse(f"{key}.group_size", size, "a group strategy needs a positive group size")
    return Scheme(name, fmt, tuple(targets), strategy, size if strategy == "group" else None)
  if fmt == FLOAT:
    if bits != 8 or kind != "float":
      raise _refuse(f"{key}.num_bits/type", (bits, kind), "float-quantized reads FP8 (8-bit)")
    if strategy not in _FP8_STRATEGIES:
      raise _refuse(f"{key}.strategy", strategy, f"expected one of {_FP8_STRATEGIES}")
    return Scheme(name, fmt, tuple(targets), strategy)
  raise _refuse("format", fmt, f"jaxspec reads {PACKED!r} (INT4) and {FLOAT!r} (FP8)")


def parse(qc: dict) -> CTConfig:
  """A validated compressed-tensors `quantization_config` (ConfigError naming the key)."""
  status = qc.get("quantization_status", "compressed")
  if status != "compressed":
    raise _refuse("quantization_status", status, "only compressed checkpoints are read")
  for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
    if qc.get(key):
      raise _refuse(key, qc[key], "not supported")
  groups = qc.get("config_groups")
  if not isinstance(groups, dict) or not groups:
    raise _refuse("config_groups", groups, "must name at least one group")
  ignore = qc.get("ignore") or []
  if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
    raise _refuse("ignore", ignore, "must be a list of module names")
  schemes = tuple(_scheme(n, g, qc.get("format")) for n, g in groups.items())
  return CTConfig(schemes, tuple(ignore))


def _matches(module: str, target: str, linear: bool) -> bool:
  if target.startswith("re:"):
    return re.match(target[3:], module) is not None
  return target == module or (target == "Linear" and linear)


def scheme_of(cfg: CTConfig, module: str, linear: bool) -> Scheme | None:
  """The scheme a module (its stored name) is quantized by, or None (kept in float)."""
  if any(_matches(module, i, linear) for i in cfg.ignore):
    return None
  for s in cfg.schemes:
    if any(_matches(module, t, linear) for t in s.targets):
      return s
  return None


def entries(qc: dict, src: Any, needed: list) -> dict:
  """{hf name: ("compressed-tensors", stored names, Scheme)} for each weight the config
  quantizes; CheckpointError where the checkpoint stores a module otherwise than its config
  says (quantized against the `ignore` list, or float though targeted)."""
  cfg = parse(qc)
  weights = [src.stored_name(hf) for hf, *_ in needed if hf.endswith(".weight")]
  _check_named_targets(cfg, [w[: -len(".weight")] for w in weights])
  names = src.keys()
  out = {}
  for hf, path, _, kind in needed:
    if not hf.endswith(".weight"):
      continue
    base = hf[: -len(".weight")]
    module = src.stored_name(hf)[: -len(".weight")]
    linear = kind in _LINEAR_KINDS and (path[-1] == "kernel" or path[-1].startswith("#"))
    scheme = scheme_of(cfg, module, linear) if linear else None
    if scheme is None:
      if f"{base}.weight_packed" in names or f"{base}.weight_scale" in names:
        raise CheckpointError(
          f"{module} is stored quantized, but the compressed-tensors config keeps it in float "
          f"(no target matches it, or `ignore` does; jaxspec reads quantized projections "
          f"only: embeddings, norms and MoE routers stay float)"
        )
      continue
    stored = tuple(f"{base}.{s}" for s in scheme.stored)
    absent = [n for n in stored if n not in names]
    if absent:
      raise CheckpointError(
        f"{module} is quantized by config group {scheme.name!r} (targets {list(scheme.targets)}"
        f", not in `ignore`), but the checkpoint lacks {absent}"
      )
    out[hf] = (METHOD, stored, scheme)
  return out


def _check_named_targets(cfg: CTConfig, modules: list[str]) -> None:
  """A plain target other than "Linear" must name a module: it could be a module class jaxspec
  does not know (e.g. "Embedding"), which would otherwise silently match nothing."""
  known = set(modules)
  for s in cfg.schemes:
    for t in s.targets:
      if not t.startswith("re:") and t != "Linear" and t not in known:
        raise _refuse(
          f"config_groups.{s.name}.targets",
          t,
          "names no module of this model (jaxspec matches module names, 're:' regexes and the "
          "class 'Linear')",
        )


def import_weight(
  src: Any,
  hf: str,
  scheme: Scheme,
  kind: str,
  shape: tuple[int, ...],
  axes: tuple[int, ...],
  dtype: str,
) -> QTensor:
  """One module's stored tensors as a QTensor of jaxspec shape `shape` ("int4" / "fp8")."""
  base = hf[: -len(".weight")]
  out, inp = layouts.hf_shape(shape, kind)
  other = tuple(d for i, d in enumerate(shape) if i - len(shape) not in axes)
  scale = src.get(f"{base}.weight_scale")
  if scheme.format == PACKED:
    declared = tuple(int(d) for d in np.asarray(src.get(f"{base}.weight_shape")).reshape(-1))
    if declared != (out, inp):
      raise CheckpointError(f"{base}.weight_shape is {list(declared)}, expected {[out, inp]}")
    packed = src.get(f"{base}.weight_packed")
    if packed.dtype != np.int32 or packed.shape != (out, -(-inp // 8)):
      raise CheckpointError(
        f"{base}.weight_packed is {packed.dtype} {list(packed.shape)}, expected int32 "
        f"{[out, -(-inp // 8)]}"
      )
    group = scheme.group or inp
    if scale.shape != (out, -(-inp // group)):
      raise CheckpointError(
        f"{base}.weight_scale has shape {list(scale.shape)}; groups of {group} over "
        f"{[out, inp]} need {[out, -(-inp // group)]}"
      )
    quantized.check_scales(scale, f"{base}.weight_scale")
    values = packed.astype("<i4").view(np.uint8).reshape(*other, -1)
    cdims = tuple(shape[len(shape) + a] for a in axes)
    return QTensor(values, scale.reshape(*other, -1), "int4", axes, dtype, (group, cdims))
  if scale.size not in (1, out) or (scheme.strategy == "channel" and scale.size != out):
    raise CheckpointError(
      f"{base}.weight_scale has shape {list(scale.shape)}; strategy {scheme.strategy!r} over "
      f"{out} output channels needs {[out, 1] if scheme.strategy == 'channel' else [1]}"
    )
  if src.shape(hf) != (out, inp):
    raise CheckpointError(f"tensor {hf} has shape {list(src.shape(hf))}, expected {[out, inp]}")
  quantized.check_scales(scale, f"{base}.weight_scale")
  per_channel = np.broadcast_to(scale.astype(np.float32).reshape(-1), (out,))
  raw = src.raw(hf, quantized.F8)
  return quantized.import_fp8_channel(raw, per_channel, kind, shape, axes, dtype)


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def export_weight(q: QTensor, hf: str, kind: str) -> dict[str, np.ndarray]:
  """The compressed-tensors tensors of one int4 module `hf` (`<module>.weight`)."""
  base = hf[: -len(".weight")]
  values = np.asarray(q.values)
  out_in = layouts.hf_shape(q.shape, kind)
  words = np.ascontiguousarray(values.reshape(out_in[0], -1)).view("<i4").astype(np.int32)
  return {
    f"{base}.weight_packed": words,
    f"{base}.weight_scale": np.ascontiguousarray(np.asarray(q.scales).reshape(out_in[0], -1)),
    f"{base}.weight_shape": np.asarray(out_in, np.int64),
  }


def export_config(modules: list[str], group: int) -> dict:
  """The `quantization_config` of a checkpoint whose int4 modules are `modules` (groups of
  `group`): one config group targeting exactly those names, every other module in float."""
  return {
    "quant_method": METHOD,
    "format": PACKED,
    "quantization_status": "compressed",
    "ignore": [],
    "config_groups": {
      "group_0": {
        "targets": sorted(modules),
        "input_activations": None,
        "output_activations": None,
        "weights": {
          "num_bits": 4,
          "type": "int",
          "symmetric": True,
          "strategy": "group",
          "group_size": group,
          "dynamic": False,
          "actorder": None,
        },
      }
    },
  }
