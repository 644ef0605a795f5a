"""The safetensors files of a checkpoint directory: lazy, confined reads and checked tensors.

A checkpoint is one `model.safetensors` or shards named by `model.safetensors.index.json`. The
index is data from wherever the checkpoint came from, so every shard it names must stay inside
the directory (`confined_path`). `TensorSource` reads tensors by name, lazily, and presents a
vision-language checkpoint's text model under the text layout's names. Files that are absent,
unreadable or not valid JSON / safetensors raise CheckpointError naming the file; so do tensors
that nothing reads (`check_unexpected`) and NaN / Inf values (`check_finite`). Targets
(`jaxspec.io.hf`) and drafters (`jaxspec.io.drafter_ckpt`) share them, and `write_file`.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from typing import Any, Callable, Iterable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxspec.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some exporters save anyway; recomputed from the config, never read.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _listing(names: list[str], n: int = 5) -> str:
  """The first `n` names and how many more: error messages stay one readable line."""
  more = f" (and {len(names) - n} more)" if len(names) > n else ""
  return f"{names[:n]}{more}"


def read_json(path: str) -> Any:
  """The JSON value in `path`; CheckpointError naming the file if it is not readable JSON."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is not readable JSON: {e}") from None


def _allowed_roots(model_dir: str) -> list[str]:
  """Real directories a checkpoint's files may resolve into: the directory itself and, for a
  Hugging Face hub cache snapshot (`models--org--name/snapshots/<rev>`), whose files are
  symlinks into the repository's `blobs/`, that `blobs/` too."""
  root = os.path.realpath(model_dir)
  roots = [root]
  parts = root.split(os.sep)
  if "snapshots" in parts[:-1]:
    repo = os.sep.join(parts[: len(parts) - 1 - parts[::-1].index("snapshots")])
    if os.path.isdir(os.path.join(repo, "blobs")):
      roots.append(os.path.join(repo, "blobs"))
  return roots


def confined_path(model_dir: str, name: str, index_path: str) -> str:
  """`model_dir/name` for a shard file that an index names, if it stays inside model_dir.

  An index is data from wherever the checkpoint came from: an absolute name, a `..` or a
  symlink leading out of the directory would make loading read an arbitrary file, so each is
  a CheckpointError (symlinks into the HF hub cache's `blobs/` are how that cache stores
  files, and are allowed).
  """
  if not isinstance(name, str) or not name or "\0" in name:
    raise CheckpointError(f"{index_path}: shard file name {name!r} is not a file name")
  path = os.path.join(model_dir, name)
  real = os.path.realpath(path)
  if os.path.isabs(name) or not any(
    os.path.commonpath([root, real]) == root for root in _allowed_roots(model_dir)
  ):
    raise CheckpointError(
      f"{index_path}: shard path {name!r} is outside the model directory {model_dir}"
    )
  return os.path.normpath(path)


def _read_weight_map(model_dir: str, index_path: str) -> dict[str, str]:
  """tensor name → shard path of a `model.safetensors.index.json`, every shard confined."""
  data = read_json(index_path)
  weight_map = data.get("weight_map") if isinstance(data, dict) else None
  if not isinstance(weight_map, dict) or not weight_map:
    raise CheckpointError(
      f"{index_path} has no weight_map object mapping tensor names to shard files"
    )
  bad = [f"{k}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str)]
  if bad:
    raise CheckpointError(
      f"{index_path}: weight_map must map tensor names to shard file names, got {_listing(bad)}"
    )
  shard = {v: confined_path(model_dir, v, index_path) for v in set(weight_map.values())}
  return {k: shard[v] for k, v in weight_map.items()}


def check_unexpected(
  model_dir: str,
  present: Iterable[str],
  known: Iterable[str],
  layout: str,
  ignorable: Callable[[str], bool] = lambda name: False,
) -> None:
  """Raises CheckpointError naming the tensors in `present` that nothing reads.

  A tensor the layout does not use means the checkpoint is not what the config describes
  (another architecture, more layers, biases the config turns off): loading the rest would run
  a different model than the one saved. Names ending in IGNORED_SUFFIXES and those `ignorable`
  accepts are redundant in published layouts: they are skipped with a warning naming them.
  """
  extra = sorted(set(present) - set(known))
  skipped = [n for n in extra if n.endswith(IGNORED_SUFFIXES) or ignorable(n)]
  unknown = sorted(set(extra) - set(skipped))
  if unknown:
    raise CheckpointError(
      f"checkpoint in {model_dir} has {len(unknown)} tensor(s) {layout} does not use "
      f"(another architecture or config?): {_listing(unknown)}"
    )
  if skipped:
    warnings.warn(
      f"checkpoint in {model_dir}: ignoring {len(skipped)} tensor(s) {layout} does not use: "
      f"{_listing(skipped)}",
      stacklevel=3,
    )


def check_finite(name: str, w: np.ndarray, where: str) -> None:
  """CheckpointError if tensor `name` (already in memory) holds NaN or Inf: one cheap pass."""
  if not np.isfinite(w).all():
    raise CheckpointError(f"tensor {name} in {where} holds NaN or Inf values")


# Vision-language checkpoints wrap the text model under a prefix; jaxspec reads the text model
# under its own names. (stored prefix, text-layout prefix), longest first:
# * `model.language_model.`: transformers' layout (Qwen3.5, and Kimi-K2.5 in memory);
# * `language_model.model.` / `language_model.lm_head.`: the LLaVA-style layout published
#   Kimi-K2.5 checkpoints store (transformers' kimi_k25 conversion mapping renames it on load).
# (transformers 5.24's save_pretrained of Kimi-K2.5 reverses that mapping lossily, e.g. the
# text q_proj written as `self_wqkv`: such a save is not a layout to read.)
TEXT_PREFIXES = (
  ("model.language_model.", "model."),
  ("language_model.model.", "model."),
  ("language_model.lm_head.", "lm_head."),
)
# The vision tower and projector of those checkpoints: left out with a warning.
VISION_PREFIXES = (
  "model.visual.",
  "model.vision_tower.",
  "model.audio_tower.",  # Gemma 4's audio encoder and both embedders
  "model.embed_vision.",
  "model.embed_audio.",
  "model.mm_projector.",
  "model.multi_modal_projector.",  # Gemma 3's
  "vision_tower.",
  "mm_projector.",
  "multi_modal_projector.",
)


def text_name(name: str) -> str | None:
  """A wrapped text-model tensor's name in the text layout, or None if `name` is not one."""
  for stored, text in TEXT_PREFIXES:
    if name.startswith(stored):
      return text + name[len(stored) :]
  return None


class TensorSource:
  """Lazy access to the tensors of one checkpoint directory (single file or sharded)."""

  def __init__(self, model_dir: str, quiet: bool = False):
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    self._handles: dict[str, Any] = {}  # shard path → open handle (its header parsed once)
    self._headers: dict[str, dict] = {}  # shard path → its JSON header, for raw reads
    if os.path.exists(index):
      self.file_of = _read_weight_map(model_dir, index)
      missing = sorted({v for v in self.file_of.values() if not os.path.exists(v)})
      if missing:
        raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
    elif os.path.exists(single):
      self.file_of = {k: single for k in self._keys(single)}
    else:
      raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    self._stored: dict[str, str] = {}  # name read → name in the files (multimodal layout)
    if any(text_name(k) is not None for k in self.file_of):
      self._text_only(model_dir, quiet)

  def _text_only(self, model_dir: str, quiet: bool) -> None:
    """A vision-language checkpoint (Qwen3.5, Kimi-K2.5): its text model's tensors under the
    text layout's names (`TEXT_PREFIXES`), the vision tower's and projector's
    (`VISION_PREFIXES`) left out with a warning."""
    visual = [k for k in self.file_of if k.startswith(VISION_PREFIXES)]
    files = {}
    for k, path in self.file_of.items():
      if k.startswith(VISION_PREFIXES):
        continue
      name = text_name(k) or k
      if name in files:
        raise CheckpointError(f"{model_dir} holds both {self._stored.get(name, name)} and {k}")
      files[name] = path
      self._stored[name] = k
    self.file_of = files
    if visual and not quiet:
      where = sorted({p + "*" for p in VISION_PREFIXES for v in visual if v.startswith(p)})
      warnings.warn(
        f"checkpoint in {model_dir}: ignoring the {len(visual)} vision-tower tensor(s) "
        f"({', '.join(where)}): jaxspec runs the text model",
        stacklevel=4,
      )

  def _open(self, path: str):
    """The open safetensors handle of `path`: its header parsed once per shard, however many
    tensors are read from it (Kimi-K2's index names ~70K tensors in 64 shards)."""
    if path not in self._handles:
      self._handles[path] = open_safetensors(path).__enter__()
    return self._handles[path]

  def _keys(self, path: str) -> list[str]:
    return list(self._open(path).keys())

  def keys(self) -> set[str]:
    return set(self.file_of)

  def stored_name(self, name: str) -> str:
    """The name `name` (read under the text layout's names) has in the files."""
    return self._stored.get(name, name)

  def shape(self, name: str) -> tuple[int, ...]:
    try:
      return tuple(self._handle(name).get_slice(self.stored_name(name)).get_shape())
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"cannot read tensor {name} from {self.file_of[name]}: {e}") from None

  def _handle(self, name: str):
    return self._open(self.file_of[name])

  def header(self, path: str) -> dict:
    """The JSON header of shard `path` (parsed once)."""
    if path not in self._headers:
      self._headers[path] = read_header(path)
    return self._headers[path]

  def raw(self, name: str, dtype: Any) -> np.ndarray:
    """Tensor `name` read from its file's bytes as `dtype` (for F8_E4M3 and BF16, which the
    numpy reader cannot return), under its stored name."""
    path = self.file_of[name]
    return read_raw(path, self.stored_name(name), dtype, self.header(path))

  def get(self, name: str) -> np.ndarray:
    f = self._handle(name)
    stored = self.stored_name(name)
    try:
      if f.get_slice(stored).get_dtype() == "BF16":
        return self.raw(name, ml_dtypes.bfloat16)
      return f.get_tensor(stored)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(
        f"cannot read tensor {name} from {self.file_of[name]} (truncated or corrupt?): {e}"
      )

  def close(self) -> None:
    for h in self._handles.values():
      h.__exit__(None, None, None)
    self._handles.clear()


def open_safetensors(path: str):
  """safe_open(path) for numpy; CheckpointError naming a file that is not valid safetensors."""
  try:
    return safe_open(path, framework="numpy")
  except (SafetensorError, OSError, ValueError) as e:
    raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): {e}")


def read_raw(path: str, name: str, dtype: Any, header: dict | None = None) -> np.ndarray:
  """Tensor `name` of the safetensors file `path` read from its bytes as `dtype` (for dtypes
  such as F8_E4M3 that the numpy reader cannot return); `header`: the file's, if already read."""
  header = header or read_header(path)
  info = header["tensors"].get(name)
  if info is None:
    raise CheckpointError(f"{path} holds no tensor {name}")
  begin, end = info["data_offsets"]
  with open(path, "rb") as f:
    f.seek(header["data_start"] + begin)
    data = f.read(end - begin)
  if len(data) != end - begin:
    raise CheckpointError(f"cannot read tensor {name} from {path} (truncated?)")
  return np.frombuffer(data, np.uint8).view(dtype).reshape(info["shape"])


def read_header(path: str) -> dict:
  """{"tensors": name → {dtype, shape, data_offsets}, "data_start": byte offset} of a
  safetensors file."""
  try:
    with open(path, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(size))
  except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): {e}")
  header.pop("__metadata__", None)
  return {"tensors": header, "data_start": 8 + size}


def write_file(tensors: dict[str, np.ndarray], path: str) -> None:
  """Writes `tensors` to the safetensors file `path` (bfloat16 ones through flax's writer)."""
  if any(t.dtype == ml_dtypes.bfloat16 for t in tensors.values()):
    from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel

    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, path, metadata={"format": "pt"})
  else:
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

    save_file(tensors, path, metadata={"format": "pt"})
