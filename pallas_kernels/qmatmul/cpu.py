"""The CPU kernels of kernel_cpu.cc: built on first use, registered with XLA's FFI, called here.

The source is compiled once per machine with the C++ compiler found on PATH (`$CXX`, else g++,
else clang++), with `-O3 -march=native` (or `-march=$JAXSPEC_CPU_MARCH`) against the FFI headers
jaxlib ships, into
`$JAXSPEC_KERNEL_CACHE` (default ~/.cache/jaxspec/kernels), named by a hash of the source, the
compiler, jaxlib's version and the processor's flags, so a changed source, compiler or machine
builds anew and concurrent processes never see a half-written library. Building takes a few
seconds. Where no compiler works, or JAXSPEC_CPU_KERNELS=0, `available()` is False (with the
reason in `unavailable_reason()`) and callers use the XLA reference instead.

Each format has one FFI target, `jaxspec_cpu_qmatmul_<format>`. The kernels split the output's
columns across XLA's intra-op thread pool, at most JAXSPEC_CPU_THREADS ways when that is set.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib


SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_cpu.cc")
# What the source includes from beside it: part of what a built library is keyed by.
INCLUDED = (os.path.join(os.path.dirname(SOURCE), "kernel_cpu_kn.inc"),)
TARGETS = {
  "float": "JaxspecCpuMatmulF32",
  "fp8": "JaxspecCpuMatmulFp8",
  "fp8_block": "JaxspecCpuMatmulFp8Block",
  "mxfp4": "JaxspecCpuMatmulMxfp4",
}
TARGET_PREFIX = "jaxspec_cpu_qmatmul_"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")


def march() -> str:
  """The -march the kernels are built for: JAXSPEC_CPU_MARCH, else this processor ("native")."""
  return os.environ.get("JAXSPEC_CPU_MARCH", "native")

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_flags() -> str:
  """The processor's feature flags (what -march=native compiles for)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line
  except OSError:
    pass
  return platform.processor() + platform.machine()


def cache_dir() -> str:
  return os.environ.get(
    "JAXSPEC_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "kernels")
  )


def library_path(compiler: str) -> str:
  """Where the library built from this source, compiler, jaxlib and processor lives."""
  h = hashlib.sha256()
  for source in (SOURCE, *INCLUDED):
    with open(source, "rb") as f:
      h.update(f.read())
  for part in (compiler, " ".join(FLAGS), march(), jaxlib.__version__, _cpu_flags()):
    h.update(part.encode())
  return os.path.join(cache_dir(), f"libjaxspec_qmatmul_{h.hexdigest()[:16]}.so")


def build(compiler: str) -> str:
  """Compiles kernel_cpu.cc (unless already built); returns the library's path."""
  path = library_path(compiler)
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = [compiler, *FLAGS, f"-march={march()}", "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent build of the same library is harmless
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def _load() -> None:
  if os.environ.get("JAXSPEC_CPU_KERNELS", "1") == "0":
    _state["reason"] = "disabled by JAXSPEC_CPU_KERNELS=0"
    return
  compiler = _compiler()
  if compiler is None:
    _state["reason"] = "no C++ compiler on PATH (set CXX)"
    return
  try:
    lib = ctypes.cdll.LoadLibrary(build(compiler))
    for fmt, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(
        TARGET_PREFIX + fmt, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
      )
  except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
    _state["reason"] = f"building the CPU kernels failed: {e}"
    return
  _state["lib"] = lib


def available() -> bool:
  """Whether the CPU kernels are built and registered (builds them on the first call)."""
  with _lock:
    if "loaded" not in _state:
      _load()
      _state["loaded"] = True
  return "lib" in _state


def unavailable_reason() -> str:
  available()
  return _state.get("reason", "")


def qmatmul_cpu(
  x: jax.Array, values: jax.Array, scales: Any, fmt: str, block: tuple[int, int]
) -> jax.Array:
  """x [M, K] @ the stored weight, float32 [M, N], by the CPU kernel (x is widened to float32).

  Raises RuntimeError when the kernels cannot be built (`unavailable_reason()` says why).
  """
  if not available():
    raise RuntimeError(f"the CPU matmul kernels are unavailable: {unavailable_reason()}")
  m = x.shape[0]
  if fmt == "mxfp4":
    n = values.shape[-3]
  else:
    n = values.shape[0] if fmt == "fp8_block" else values.shape[-1]
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  # Under vmap the kernel runs once per mapped element (nothing in the library maps it).
  call = functools.partial(
    jax.ffi.ffi_call, TARGET_PREFIX + fmt, out, vmap_method="sequential"
  )
  xf = x.astype(jnp.float32)
  if fmt == "float":
    return call()(xf, values.astype(jnp.float32))
  if fmt == "fp8":
    return call()(xf, values, scales.astype(jnp.float32))
  if fmt == "fp8_block":
    return call()(
      xf, values, scales.astype(jnp.float32),
      block_n=int(block[0]), block_k=int(block[1]),
    )
  return call()(xf, values, scales)
