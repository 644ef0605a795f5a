"""`pytorch_model.bin` checkpoints read without running pickled code.

Some drafters are published only as PyTorch pickles (yuhuili's EAGLE-3 heads:
`pytorch_model.bin`). A pickle can name any Python callable, so loading one with plain
`torch.load` may run code from the file. This reader uses `torch.load(weights_only=True)`,
whose unpickler accepts only tensors, containers and plain values, memory-mapping the file
(`mmap=True`) so a large checkpoint is not copied into memory twice; anything else in the
pickle is refused with a CheckpointError naming the file. `TorchBinSource` offers the
read interface of `safetensors_files.TensorSource`, so a loader takes either.
"""

from __future__ import annotations

import os
import pickle

import ml_dtypes
import numpy as np

from jaxspec.errors import CheckpointError

BIN_FILE = "pytorch_model.bin"


def _torch(path: str):
  """PyTorch, which only this reader needs (not a jaxspec dependency)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise CheckpointError(
      f"{path}: reading a pytorch_model.bin needs PyTorch (pip install torch); or convert "
      f"the checkpoint to safetensors"
    ) from None
  return torch


def _to_numpy(name: str, t, path: str) -> np.ndarray:
  torch = _torch(path)

  if not isinstance(t, torch.Tensor):
    raise CheckpointError(f"{path}: entry {name!r} is a {type(t).__name__}, not a tensor")
  t = t.detach().cpu().contiguous()
  if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
  """The tensors of a `pytorch_model.bin` state dict, read with the weights-only unpickler.

  Raises CheckpointError when the file is not a PyTorch checkpoint, when its pickle holds
  anything but tensors and plain values (a code payload is never run), or when it is not a
  flat name → tensor mapping.
  """
  torch = _torch(path)

  try:
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
  except pickle.UnpicklingError as e:
    first = (str(e).strip().splitlines() or [""])[0]
    raise CheckpointError(
      f"{path}: refusing to load a pickle that holds more than tensors (weights-only "
      f"unpickling failed: {first}); convert it to safetensors from a trusted copy"
    ) from None
  except (OSError, RuntimeError, ValueError, EOFError) as e:
    raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: {e}") from None
  if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
    state = state["state_dict"]
  if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
    raise CheckpointError(f"{path}: expected a state dict (tensor names → tensors)")
  return {k: _to_numpy(k, v, path) for k, v in state.items()}


class TorchBinSource:
  """The tensors of a directory's `pytorch_model.bin`, behind TensorSource's read methods."""

  def __init__(self, model_dir: str):
    path = os.path.join(model_dir, BIN_FILE)
    if not os.path.isfile(path):
      raise CheckpointError(f"no {BIN_FILE} in {model_dir}")
    self._tensors = read_torch_bin(path)
    self.file_of = {k: path for k in self._tensors}

  def keys(self) -> set[str]:
    return set(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._tensors[name].shape)

  def get(self, name: str) -> np.ndarray:
    return self._tensors[name]

  def close(self) -> None:
    self._tensors = {}
