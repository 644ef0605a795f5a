"""The GGUF container: header, metadata and tensor table parsed, tensors dequantized to float32.

GGUF (versions 2 and 3) is: the magic `GGUF`, a version, the tensor and key/value counts; the
key/value metadata (typed scalars, strings and arrays); one entry per tensor (name, dimensions
innermost first, ggml type, offset); then, aligned to `general.alignment` (32 by default), the
tensor data. It is parsed here in one pass over a memory map: a vocabulary's 50K-150K strings
take milliseconds (the gguf package's reader builds numpy views field by field: ~15 s for
SmolLM2's file).

Dequantization of the block formats llama.cpp files mostly use is numpy here, whole tensors at a
time: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (ggml-common.h layouts; tests check each against
`gguf.quants.dequantize`). The K-quants (Q4_K, Q5_K, Q6_K) and the other ggml types go through
`gguf.quants.dequantize` of the gguf package, an optional dependency imported only then.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec.errors import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {
  0: "B",
  1: "b",
  2: "H",
  3: "h",
  4: "I",
  5: "i",
  6: "f",
  7: "?",
  10: "Q",
  11: "q",
  12: "d",
}
_NUMPY = {
  0: np.uint8,
  1: np.int8,
  2: np.uint16,
  3: np.int16,
  4: np.uint32,
  5: np.int32,
  6: np.float32,
  7: np.bool_,
  10: np.uint64,
  11: np.int64,
  12: np.float64,
}
STRING, ARRAY = 8, 9
# ggml types dequantized here: id → (name, elements per block, bytes per block).
NATIVE_TYPES = {
  0: ("F32", 1, 4),
  1: ("F16", 1, 2),
  30: ("BF16", 1, 2),
  8: ("Q8_0", 32, 34),
  2: ("Q4_0", 32, 18),
  3: ("Q4_1", 32, 20),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor's table entry: `shape` as numpy (outermost first), `type` ggml's id."""

  name: str
  shape: tuple[int, ...]
  type: int
  offset: int  # from the file's start
  nbytes: int

  @property
  def type_name(self) -> str:
    return type_name(self.type)


def type_name(ggml_type: int) -> str:
  """ggml's name of a tensor type id (F32, Q4_K, ...)."""
  if ggml_type in NATIVE_TYPES:
    return NATIVE_TYPES[ggml_type][0]
  try:
    import gguf  # pylint: disable=import-outside-toplevel

    return gguf.GGMLQuantizationType(ggml_type).name
  except (ImportError, ValueError):
    return f"type {ggml_type}"


def _block(ggml_type: int, path: str, name: str) -> tuple[int, int]:
  if ggml_type in NATIVE_TYPES:
    return NATIVE_TYPES[ggml_type][1:]
  gguf = _gguf_package(f"tensor {name} of type {type_name(ggml_type)}")
  try:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
  except (ValueError, KeyError):
    raise CheckpointError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None


def _gguf_package(what: str) -> Any:
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise CheckpointError(
      f"reading {what} needs the gguf package: pip install gguf (or jaxspec[gguf])"
    ) from None
  return gguf


class _Cursor:
  """Sequential little-endian reads from a buffer; a read past the end is a CheckpointError."""

  def __init__(self, buf: Any, path: str):
    self.buf, self.pos, self.path = buf, 0, path

  def unpack(self, fmt: str) -> Any:
    fmt = "<" + fmt
    size = struct.calcsize(fmt)
    if self.pos + size > len(self.buf):
      raise CheckpointError(f"{self.path}: GGUF file ends early (truncated?)")
    (value,) = struct.unpack_from(fmt, self.buf, self.pos)
    self.pos += size
    return value

  def string(self) -> str:
    n = self.unpack("Q")
    if self.pos + n > len(self.buf):
      raise CheckpointError(f"{self.path}: GGUF file ends early (truncated?)")
    raw = bytes(self.buf[self.pos : self.pos + n])
    self.pos += n
    return raw.decode("utf-8", errors="replace")

  def value(self, vtype: int) -> Any:
    if vtype in _SCALARS:
      return self.unpack(_SCALARS[vtype])
    if vtype == STRING:
      return self.string()
    if vtype == ARRAY:
      itype, count = self.unpack("I"), self.unpack("Q")
      if itype in _NUMPY:
        dtype = np.dtype(_NUMPY[itype]).newbyteorder("<")
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
          raise CheckpointError(f"{self.path}: GGUF file ends early (truncated?)")
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos = end
        return values
      return [self.value(itype) for _ in range(count)]
    raise CheckpointError(f"{self.path}: unknown GGUF metadata value type {vtype}")


class GGUFFile:
  """A GGUF file's metadata (`fields`: key → Python value) and tensors (`tensors`: name →
  TensorInfo); `read(name)` dequantizes one to float32."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    cur = _Cursor(self._map, path)
    if bytes(self._map[:4]) != MAGIC:
      raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    self.version = cur.unpack("I")
    if self.version not in (2, 3):
      raise CheckpointError(f"{path}: GGUF version {self.version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    self.fields: dict[str, Any] = {}
    for _ in range(n_kv):
      key = cur.string()
      self.fields[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
      name = cur.string()
      dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
      infos.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
    align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    start = -(-cur.pos // align) * align
    self.tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
      block, size = _block(ggml_type, path, name)
      if shape and shape[-1] % block:
        raise CheckpointError(f"{path}: tensor {name} rows of {shape[-1]} are not whole blocks")
      nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
      if start + offset + nbytes > len(self._map):
        raise CheckpointError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
      self.tensors[name] = TensorInfo(name, shape, ggml_type, start + offset, nbytes)

  def raw(self, name: str) -> np.ndarray:
    """The stored bytes of tensor `name` (uint8, read-only view of the file)."""
    t = self.tensors[name]
    return np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)

  def read(self, name: str) -> np.ndarray:
    """Tensor `name` dequantized to float32, in numpy's shape (outermost dimension first)."""
    t = self.tensors[name]
    return dequantize(self.raw(name), t.type, t.shape)


def _f16(raw: np.ndarray) -> np.ndarray:
  return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
  """A block's 4-bit values in element order: the low nibbles (elements 0-15), then the high."""
  return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  """float32 values of `shape` from the stored bytes of a tensor of ggml type `ggml_type`."""
  if ggml_type not in NATIVE_TYPES:
    gguf = _gguf_package(f"a {type_name(ggml_type)} tensor")
    rows = raw.reshape(-1, len(raw) // max(int(np.prod(shape[:-1], dtype=np.int64)), 1))
    out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(ggml_type))
    return np.asarray(out, np.float32).reshape(shape)
  name, _, size = NATIVE_TYPES[ggml_type]
  if name == "F32":
    return raw.view(np.float32).reshape(shape).copy()
  if name == "F16":
    return raw.view(np.float16).astype(np.float32).reshape(shape)
  if name == "BF16":
    return raw.view(ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
  blocks = raw.reshape(-1, size)
  d = _f16(blocks[:, :2])
  if name == "Q8_0":
    w = d * blocks[:, 2:].view(np.int8).astype(np.float32)
  elif name == "Q4_0":
    w = d * (_nibbles(blocks[:, 2:]) - 8.0)
  else:  # Q4_1: scale and minimum
    w = d * _nibbles(blocks[:, 4:]) + _f16(blocks[:, 2:4])
  return w.reshape(shape)
