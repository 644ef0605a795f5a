"""Building drafters by name or from a checkpoint directory (`jaxspec.load_drafter`)."""

from __future__ import annotations

import os
from typing import Optional

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.io import hf as hf_io
from jaxspec.models.target import InputError, TargetModel

METHODS = ("plain", "draft_model", "ngram", "mtp")


def load_drafter(path: str, target: TargetModel, gamma: int = 4) -> Drafter:
  """Loads the drafter stored in `path` for `target` (an HF causal LM: a draft model)."""
  if not os.path.isdir(path):
    raise hf_io.CheckpointError(f"drafter directory {path!r} does not exist")
  model = hf_io.load_model(path)
  if model.config.vocab_size != target.config.vocab_size:
    raise InputError(f"drafter vocabulary ({model.config.vocab_size}) differs from the target's "
                     f"({target.config.vocab_size})")
  return DraftModelDrafter.from_model(model, gamma=gamma)


def make_drafter(method: str, target: TargetModel, *, gamma: int = 4,
                 draft_dir: Optional[str] = None, ngram_n: int = 3) -> Optional[Drafter]:
  """The drafter for a method name; None for plain decoding."""
  if method == "plain":
    return None
  if method == "ngram":
    return NgramDrafter(gamma=gamma, n=ngram_n)
  if method == "mtp":
    return MTPDrafter.from_target(target, gamma=gamma)
  if method == "draft_model":
    if not draft_dir:
      raise ValueError("method 'draft_model' needs a draft model directory")
    return load_drafter(draft_dir, target, gamma)
  raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
