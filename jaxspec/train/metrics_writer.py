"""Scalar metrics in TensorBoard's event-file format, with no TensorFlow or tensorboard import.

An event file is a TFRecord stream: each record is
`len (u64 le) | masked crc32c(len) (u32) | data | masked crc32c(data) (u32)`, where `data` is
a serialized `tensorflow.Event` protobuf. Only three message shapes are needed, so they are
encoded by hand:

  Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary { repeated Value value = 1; }
  Value   { string tag = 1; float simple_value = 2; }

`tensorboard --logdir <workdir>/tb` reads the files. A JSON-lines copy (`metrics.jsonl`) is
written beside them for scripts and tests.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Mapping


def _crc32c_table() -> list[int]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as TFRecord uses."""
  c = 0xFFFFFFFF
  for b in data:
    c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field_bytes(num: int, payload: bytes) -> bytes:
  return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _event(
  step: int,
  wall_time: float,
  *,
  file_version: str | None = None,
  scalars: Mapping[str, float] | None = None,
) -> bytes:
  msg = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
  if file_version is not None:
    msg += _field_bytes(3, file_version.encode())
  if scalars:
    values = b"".join(
      _field_bytes(
        1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", float(v))
      )
      for tag, v in scalars.items()
    )
    msg += _field_bytes(5, values)
  return msg


def _record(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return (
    header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))
  )


class MetricsWriter:
  """Appends scalar summaries to `<logdir>/events.out.tfevents.*` and `<logdir>/metrics.jsonl`.

  A resumed run opens a new event file in the same folder; TensorBoard merges them by step.
  """

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    self.logdir = logdir
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._events = open(self.path, "ab")
    self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")
    self._events.write(_record(_event(0, time.time(), file_version="brain.Event:2")))
    self._events.flush()

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes one event holding every scalar of `scalars` at `step`."""
    scalars = {k: float(v) for k, v in scalars.items()}
    self._events.write(_record(_event(int(step), time.time(), scalars=scalars)))
    self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")

  def flush(self) -> None:
    self._events.flush()
    self._jsonl.flush()

  def close(self) -> None:
    self.flush()
    self._events.close()
    self._jsonl.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
