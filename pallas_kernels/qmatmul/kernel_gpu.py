"""Pallas (GPU) dense quantized matmul. Placeholder: being written."""

from __future__ import annotations

from typing import Any

import jax


def qmatmul_gpu(
  x: jax.Array, values: jax.Array, scales: Any, fmt: str, block: tuple[int, int],
  interpret: bool = False,
) -> jax.Array:
  raise NotImplementedError("the GPU quantized matmul is not written yet")
