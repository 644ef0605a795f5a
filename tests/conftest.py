"""Test-session hygiene shared by every test module, and the persistent compilation cache."""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable

import jax
import pytest

import jaxspec
from jaxspec.drafters.base import Drafter
from jaxspec.models.target import TargetModel

ASSETS = os.path.join(os.path.dirname(jaxspec.__file__), "assets")

# JAX's persistent compilation cache, beside the CPU kernels' build cache in the user's cache
# directory ($XDG_CACHE_HOME or ~/.cache, then jaxspec/jax-compilation-cache), so that every
# checkout of the machine and every later run share it. Most of the suite's time is XLA
# compiling, and the same programs recur: every engine jits its own functions, so two engines
# of one configuration compile the same program twice, and `_drop_compiled_programs` below
# empties the in-memory caches after each module. The disk cache turns those repeats into
# reads, within a run (across modules, xdist workers and the subprocesses tests start) and
# across runs. A cold or absent cache is only slower: entries are keyed by the program, the
# compile options and the jax/XLA versions. JAXSPEC_TEST_JAX_CACHE=0 turns it off; a path
# puts it there.
CACHE_ENV = "JAXSPEC_TEST_JAX_CACHE"
# No size bound: with one, jax takes a file lock and sums the directory's sizes on every write,
# so two workers writing thousands of entries wait on each other for minutes. Without it each
# entry is one file write (jax recompiles, with a warning, if it ever reads a torn entry).


def pytest_configure(config: pytest.Config) -> None:
  """Points jax, and the subprocesses tests start (through the environment), at the cache."""
  where = os.environ.get(CACHE_ENV, "")
  if where == "0":
    return
  if not where:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    where = os.path.join(base, "jaxspec", "jax-compilation-cache")
  settings = {
    "jax_compilation_cache_dir": where,
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
    "jax_compilation_cache_max_size": -1,
  }
  for name, value in settings.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)


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


@pytest.fixture(scope="session")
def target() -> TargetModel:
  """The bundled target (jaxspec/assets/target), loaded once per process; a module testing
  another target defines its own `target`. Shared: never modify it in place."""
  return jaxspec.load_model(os.path.join(ASSETS, "target"))


@pytest.fixture(scope="session")
def bundled_drafter(target: TargetModel) -> Callable[[str], Drafter]:
  """kind ("eagle3", "dflash", "draft") → the bundled drafter of that kind for the bundled
  target, each loaded once per process."""
  return functools.cache(lambda kind: jaxspec.load_drafter(os.path.join(ASSETS, kind), target))
