"""Quantized weights (jaxspec.quant) in HF safetensors checkpoints, kept in their formats.

A weight stored quantized replaces its HF tensor `<base>.weight` by:

* MXFP4: `<base>_blocks` uint8 [out, in / 32, 16] and `<base>_scales` uint8 [out, in / 32],
  gpt-oss's layout (blocks along the input dimension, the even element in the low nibble).
  Routed experts are stacked per layer as gpt-oss stores them:
  `model.layers.{i}.mlp.experts.{gate,up,down}_proj_blocks` [E, out, in / 32, 16] and
  `..._scales` [E, out, in / 32].
* FP8: `<base>.weight` as F8_E4M3 in HF's [out, in] layout and `<base>.weight_scale` float32
  [out], one scale per output channel; routed experts stacked likewise
  (`...experts.gate_proj.weight` [E, out, in], `...experts.gate_proj.weight_scale` [E, out]).

config.json says so under `quantization_config` (`quant_method: "jaxspec"`, the policy and
each weight's format). Reading keeps the packed arrays: no dequantized copy is ever made.

FP8 checkpoints with block scales (DeepSeek-V3, Qwen3-FP8: `quant_method: "fp8"`,
`weight_block_size: [128, 128]`; each quantized `<name>.weight` is F8_E4M3 [out, in] beside
`<name>.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], the factor each block's
values are multiplied by) load as "fp8_block" weights, kept as stored and written back alike.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import ml_dtypes
import numpy as np

from jaxspec.errors import CheckpointError
from jaxspec.io import layouts
from jaxspec.io import safetensors_files
from jaxspec.quant.formats import QTensor, check_mxfp4_scales
from jaxspec.quant.policy import path_str, role_of

QUANT_METHOD = "jaxspec"
HF_MXFP4_METHOD = "mxfp4"  # gpt-oss: MXFP4 experts, everything else unquantized
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
read_raw = safetensors_files.read_raw  # F8_E4M3 tensors straight from a file's bytes


def base_name(hf_name: str) -> str:
  return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name


def expert_base(hf_name: str) -> Optional[str]:
  """`model.layers.3.mlp.experts.7.gate_proj.weight` → `model.layers.3.mlp.experts.gate_proj`."""
  parts = hf_name.split(".")
  if "experts" not in parts:
    return None
  i = parts.index("experts")
  return ".".join(parts[: i + 1] + parts[i + 2 : -1])


# ------------------------------------------------------------------------------------------------
# Layouts: jaxspec's stored arrays ↔ HF's, per tensor kind (see io/layouts.py)
# ------------------------------------------------------------------------------------------------


def _mx_to_hf(values: np.ndarray, scales: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
  """Stored [*other, nb, 16] / [*other, nb] (other = the weight's axes but the block axis) →
  HF [*lead, out, in / 32, 16] / [*lead, out, in / 32]. gpt-oss's stacked experts ("same":
  HF stores them [E, in, out] as jaxspec does) keep the stored layout."""
  if kind in ("linear", "same"):
    return values, scales
  if kind == "in_heads":  # other [heads, D]: out = heads·D
    return (
      values.reshape(*values.shape[:-4], -1, *values.shape[-2:]),
      scales.reshape(*scales.shape[:-3], -1, scales.shape[-1]),
    )
  if kind == "out_heads":  # other [heads, H], blocks along D: in = heads·D
    v = np.swapaxes(values, -4, -3)  # [H, heads, nb, 16]
    s = np.swapaxes(scales, -3, -2)
    return v.reshape(*v.shape[:-3], -1, 16), s.reshape(*s.shape[:-2], -1)
  raise CheckpointError(f"no MXFP4 layout for a {kind} tensor")


def _mx_from_hf(
  values: np.ndarray, scales: np.ndarray, kind: str, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
  """Inverse of `_mx_to_hf` for a weight of jaxspec shape `shape`."""
  if kind in ("linear", "same"):
    return values, scales
  if kind == "in_heads":  # shape [H, heads, D]
    heads, d = shape[-2:]
    return (
      values.reshape(*values.shape[:-3], heads, d, *values.shape[-2:]),
      scales.reshape(*scales.shape[:-2], heads, d, scales.shape[-1]),
    )
  if kind == "out_heads":  # shape [heads, D, H]
    heads, d, h = shape[-3:]
    v = values.reshape(*values.shape[:-3], h, heads, d // 32, 16)
    s = scales.reshape(*scales.shape[:-2], h, heads, d // 32)
    return np.swapaxes(v, -4, -3), np.swapaxes(s, -3, -2)
  raise CheckpointError(f"no MXFP4 layout for a {kind} tensor")


def _fp8_to_hf(values: np.ndarray, scales: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
  if kind == "same":  # jaxspec's layout is the HF one
    return values, scales
  if kind == "linear":
    return np.swapaxes(values, -1, -2), scales
  if kind == "in_heads":  # [H, heads, D] → [heads·D, H]; scales [heads, D] → [heads·D]
    v = values.reshape(*values.shape[:-2], -1)
    return np.swapaxes(v, -1, -2), scales.reshape(*scales.shape[:-2], -1)
  if kind == "out_heads":  # [heads, D, H] → [H, heads·D]; scales [H]
    v = values.reshape(*values.shape[:-3], -1, values.shape[-1])
    return np.swapaxes(v, -1, -2), scales
  raise CheckpointError(f"no FP8 layout for a {kind} tensor")


def _fp8_from_hf(
  values: np.ndarray, scales: np.ndarray, kind: str, shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
  if kind == "same":
    return values, scales
  v = np.swapaxes(values, -1, -2)
  if kind == "linear":
    return v, scales
  if kind == "in_heads":
    return v.reshape(shape), scales.reshape(shape[-2:])
  if kind == "out_heads":
    return v.reshape(shape), scales
  raise CheckpointError(f"no FP8 layout for a {kind} tensor")


# ------------------------------------------------------------------------------------------------
# Writing and reading
# ------------------------------------------------------------------------------------------------


def export_qtensor(q: QTensor, kind: str, base: str) -> dict[str, np.ndarray]:
  """The HF tensors of one quantized weight (or one layer's stack of experts) named `base`."""
  values, scales = np.asarray(q.values), np.asarray(q.scales)
  if q.format == "mxfp4":
    v, s = _mx_to_hf(values, scales, kind)
    return {f"{base}_blocks": np.ascontiguousarray(v), f"{base}_scales": np.ascontiguousarray(s)}
  v, s = _fp8_to_hf(values, scales, kind)
  return {
    f"{base}.weight": np.ascontiguousarray(v.astype(F8)),
    f"{base}.weight_scale": np.ascontiguousarray(s.astype(np.float32)),
  }


def is_hf_mxfp4(config: Any, params: Any) -> bool:
  """Whether a gpt-oss model holds exactly gpt-oss's published format: its routed experts
  (and nothing else) MXFP4, so that transformers loads the checkpoint as `quant_method:
  "mxfp4"`."""
  if not config.family.hf_mxfp4:
    return False
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))
  quantized = [(path_str(p), x) for p, x in leaves if isinstance(x, QTensor)]
  return bool(quantized) and all(
    x.format == "mxfp4" and role_of(p) == "experts" for p, x in quantized
  )


def hf_mxfp4_config() -> dict[str, Any]:
  """The `quantization_config` of a gpt-oss MXFP4 checkpoint (what transformers reads)."""
  return {
    "quant_method": HF_MXFP4_METHOD,
    "modules_to_not_convert": [
      "model.layers.*.self_attn",
      "model.layers.*.mlp.router",
      "model.embed_tokens",
      "lm_head",
    ],
  }


def stored_format(names: set[str], base: str) -> Optional[str]:
  """ "mxfp4" / "fp8" when the checkpoint holds `base` quantized, else None."""
  if f"{base}_blocks" in names or f"{base}_scales" in names:
    return "mxfp4"
  if f"{base}.weight_scale" in names:
    return "fp8"
  return None


def import_qtensor(
  src: Any,
  base: str,
  fmt: str,
  kind: str,
  shape: tuple[int, ...],
  axes: tuple[int, ...],
  dtype: str,
) -> QTensor:
  """Reads `base` in `fmt` as a QTensor of jaxspec shape `shape` (experts: [E, ...])."""
  if fmt == "mxfp4":
    names = (f"{base}_blocks", f"{base}_scales")
  else:
    names = (f"{base}.weight", f"{base}.weight_scale")
  missing = [n for n in names if n not in src.file_of]
  if missing:
    raise CheckpointError(f"quantized weight {base} lacks {missing}")
  if fmt == "mxfp4":
    blocks, scales = src.get(names[0]), src.get(names[1])
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
      raise CheckpointError(f"{base}: MXFP4 blocks and scales must be uint8")
    check_mxfp4_scales(scales, names[1])
    values, scales = _mx_from_hf(blocks, scales, kind, shape)
  else:
    raw = src.raw(names[0], F8)
    values, scales = _fp8_from_hf(raw, src.get(names[1]).astype(np.float32), kind, shape)
  q = QTensor(values, scales, fmt, tuple(axes), dtype)
  if q.shape != tuple(shape):
    raise CheckpointError(f"{base}: stored {fmt} tensors hold a {q.shape} weight, not {shape}")
  return q


def import_fp8_block(
  src: Any, name: str, kind: str, shape: tuple[int, ...], block: tuple[int, int], dtype: str
) -> QTensor:
  """Reads one block-scaled FP8 weight `name` (HF [out, in]) as an "fp8_block" QTensor."""
  want = layouts.hf_shape(shape, kind)
  if src.shape(name) != want:
    raise CheckpointError(f"tensor {name} has shape {list(src.shape(name))}, expected {list(want)}")
  values = src.raw(name, F8)
  scales = src.get(f"{name}_scale_inv").astype(np.float32)
  grid = tuple(-(-n // b) for n, b in zip(want, block))
  if scales.shape != grid:
    raise CheckpointError(
      f"{name}_scale_inv has shape {list(scales.shape)}; blocks of {list(block)} over "
      f"{list(want)} need {list(grid)}"
    )
  if not np.isfinite(scales).all():
    raise CheckpointError(f"{name}_scale_inv holds non-finite scales")
  return QTensor(values, scales, "fp8_block", (), dtype, (kind, tuple(shape), tuple(block)))


def export_fp8_block(q: QTensor, name: str) -> dict[str, np.ndarray]:
  return {
    name: np.ascontiguousarray(np.asarray(q.values).astype(F8)),
    f"{name}_scale_inv": np.ascontiguousarray(np.asarray(q.scales, np.float32)),
  }


def import_fp8_channel(
  raw: np.ndarray,
  scales: np.ndarray,
  kind: str,
  shape: tuple[int, ...],
  axes: tuple[int, ...],
  dtype: str,
) -> QTensor:
  """An FP8 weight stored HF [out, in] with one float32 scale per output channel [out] (e.g.
  compressed-tensors' float-quantized "channel" strategy) as an "fp8" QTensor of `shape`."""
  values, scales = _fp8_from_hf(raw, scales, kind, shape)
  return QTensor(values, np.ascontiguousarray(scales), "fp8", tuple(axes), dtype)


def check_scales(scales: np.ndarray, name: str) -> None:
  """Refuses scales that are not finite (a damaged checkpoint would dequantize to NaN)."""
  if not np.isfinite(np.asarray(scales, np.float32)).all():
    raise CheckpointError(f"{name} holds non-finite scales")
