"""Tensor layouts between Hugging Face checkpoints and jaxspec's parameter trees.

Each tensor entry of a layout table names a *kind*:

* same: identical; linear: HF [out, in] <-> [in, out];
* in_heads: HF [heads*D, in] <-> [in, heads, D]; out_heads: HF [H, heads*D] <-> [heads, D, H];
* bias_heads: HF [heads*D] <-> [heads, D];
* conv: HF depthwise Conv1d [C, 1, K] <-> [K, C];
* experts_linear: HF stacked experts [E, out, in] <-> [E, in, out] (Gemma 4).

Targets (`jaxspec.io.hf`), quantized tensors (`jaxspec.io.quantized`) and drafters
(`jaxspec.io.drafter_ckpt`) share these conversions.
"""

from __future__ import annotations

import numpy as np


def to_jax_layout(w: np.ndarray, kind: str, target_shape: tuple[int, ...]) -> np.ndarray:
  """An HF tensor in jaxspec's layout of `kind` (see the module docstring)."""
  if kind == "same":
    return w
  if kind == "linear":
    return w.T
  if kind == "in_heads":
    return w.T.reshape(target_shape)
  if kind == "out_heads":
    return w.T.reshape(target_shape)
  if kind == "bias_heads":
    return w.reshape(target_shape)
  if kind == "conv":  # HF depthwise Conv1d [C, 1, K] ↔ jaxspec [K, C]
    return w[:, 0, :].T
  if kind == "experts_linear":
    return np.swapaxes(w, -1, -2)
  raise AssertionError(kind)


def to_hf_layout(w: np.ndarray, kind: str) -> np.ndarray:
  """Inverse of `to_jax_layout`."""
  if kind == "same":
    return w
  if kind == "linear":
    return w.T
  if kind == "in_heads":  # [H, heads, D] → [heads*D, H]
    return w.reshape(w.shape[0], -1).T
  if kind == "out_heads":  # [heads, D, H] → [H, heads*D]
    return w.reshape(-1, w.shape[-1]).T
  if kind == "bias_heads":
    return w.reshape(-1)
  if kind == "conv":
    return w.T[:, None, :]
  if kind == "experts_linear":
    return np.swapaxes(w, -1, -2)
  raise AssertionError(kind)


def hf_shape(target_shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
  """The HF shape of a jaxspec tensor of `target_shape` and layout `kind`."""
  return tuple(to_hf_layout(np.empty(target_shape, np.uint8), kind).shape)
