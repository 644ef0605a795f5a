"""Pallas (TPU) dense quantized matmul. Placeholder: being written."""

from __future__ import annotations

from typing import Any

import jax


def qmatmul_tpu(
  x: jax.Array, values: jax.Array, scales: Any, fmt: str, block: tuple[int, int],
  interpret: bool = False,
) -> jax.Array:
  raise NotImplementedError("the TPU quantized matmul is not written yet")
