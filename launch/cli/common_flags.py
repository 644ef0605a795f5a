"""The flags several launch scripts share, each defined in one place.

`--max_len`, `--out` and `--kv_format` used to be defined by each script on its own, with
different help texts and types (`--kv_format` an enum in some scripts, a free string in
others). A script calls `define_max_len(default)` and so on instead: the default stays the
script's own (a planner sizes a 32K context, a smoke benchmark 256 tokens), the meaning and the
accepted values are the same everywhere.

Each `define_*` defines its flag once per process (a second call is a no-op) and lists it in
the script's `--help` (absl lists only the main module's key flags there).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from absl import flags

from jaxspec.state import KV_FORMATS

FLAGS = flags.FLAGS


def key_flags(names: Sequence[str]) -> None:
  """Lists the flags `names` in the running script's `--help`, as its own flags are."""
  for name in names:
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def define_max_len(default: int, note: str = "") -> None:
  """--max_len: tokens per sequence the engine's cache holds (prompt + generated + slack)."""
  if "max_len" in FLAGS:
    return
  text = "Tokens per sequence the cache holds (prompt + generated + draft slack)."
  flags.DEFINE_integer("max_len", default, f"{text} {note}".strip(), lower_bound=0)
  key_flags(["max_len"])


def define_out(default: Optional[str], what: str) -> None:
  """--out: where the script writes its results; `what` says what is written there."""
  if "out" in FLAGS:
    return
  flags.DEFINE_string("out", default, f"Output: {what}.")
  key_flags(["out"])


def define_kv_format(default: str = "float") -> None:
  """--kv_format: how the target's KV cache is stored, one of `jaxspec.state.KV_FORMATS`."""
  if "kv_format" in FLAGS:
    return
  flags.DEFINE_enum(
    "kv_format", default, tuple(KV_FORMATS), "How the target's KV cache is stored."
  )
  key_flags(["kv_format"])


def define_kv_formats(default: Sequence[str] = tuple(KV_FORMATS)) -> None:
  """--kv_formats: the KV cache formats a benchmark compares, each of `KV_FORMATS`."""
  if "kv_formats" in FLAGS:
    return
  flags.DEFINE_list("kv_formats", list(default), "KV cache formats to compare.")
  flags.register_validator(
    "kv_formats",
    lambda values: all(v in KV_FORMATS for v in values),
    message=f"each of --kv_formats must be one of {', '.join(KV_FORMATS)}",
  )
  key_flags(["kv_formats"])
