"""Test-session hygiene shared by every test module."""

from __future__ import annotations

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Drops the module's compiled programs when it ends.

  XLA:CPU keeps memory mappings for every executable a jit cache holds. One process running
  the whole suite otherwise accumulates thousands of them (every shape and config of every
  module) and can reach the kernel's per-process mapping limit (vm.max_map_count, 65530),
  where a later compile crashes with a segmentation fault.
  """
  yield
  jax.clear_caches()
  gc.collect()
