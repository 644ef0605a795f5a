"""Building drafters by name or from a checkpoint directory (`jaxspec.load_drafter`)."""

from __future__ import annotations

import os
from typing import Any, Optional

from jaxspec.drafters import dflash, eagle3
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.io import drafter_ckpt
from jaxspec.io import hf as hf_io
from jaxspec.models.target import InputError, TargetModel

METHODS = ("plain", "draft_model", "ngram", "mtp", "dflash", "eagle3")
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def bundled_dir(name: str) -> Optional[str]:
  """jaxspec/assets/<name> ("target", "draft", "dflash", "eagle3") if it holds a checkpoint."""
  path = os.path.join(ASSETS_DIR, name)
  return path if os.path.exists(os.path.join(path, "config.json")) else None


def checkpoint_kind(path: str) -> str:
  """'dflash', 'eagle3' or 'draft_model' for a drafter checkpoint directory."""
  if not os.path.isdir(path):
    raise hf_io.CheckpointError(f"drafter directory {path!r} does not exist")
  kind = drafter_ckpt.detect_kind(hf_io.read_config(path))
  return "draft_model" if kind == "causal_lm" else kind


def load_drafter(
  path: str, target: TargetModel, gamma: Optional[int] = None, **kwargs: Any
) -> Drafter:
  """Loads the drafter stored in `path` for `target`, whichever layout config.json names.

  DFlash (`DFlashDraftModel`) and EAGLE-3 (`LlamaForCausalLMEagle3`) checkpoints load in their
  published layouts; anything else must be an HF causal LM (a draft model). `gamma` is the
  number of draft tokens per step (default: 4 for chains, block_size − 1 for DFlash); `kwargs`
  go to the drafter (e.g. sample_drafts, context_window).
  """
  kind = checkpoint_kind(path)
  if kind == "dflash":
    return dflash.load_dflash(path, target, gamma=gamma or 0, **kwargs)
  if kind == "eagle3":
    return eagle3.load_eagle3(path, target, gamma=gamma or 4, **kwargs)
  model = hf_io.load_model(path)
  if model.config.vocab_size != target.config.vocab_size:
    raise InputError(
      f"drafter vocabulary ({model.config.vocab_size}) differs from the target's "
      f"({target.config.vocab_size})"
    )
  return DraftModelDrafter.from_model(model, gamma=gamma or 4)


def save_drafter(drafter: Drafter, out_dir: str) -> None:
  """Exports a DFlash or EAGLE-3 drafter in its published layout (config.json + safetensors)."""
  if isinstance(drafter, dflash.DFlashDrafter):
    dflash.save_dflash(drafter, out_dir)
  elif isinstance(drafter, eagle3.Eagle3Drafter):
    eagle3.save_eagle3(drafter, out_dir)
  else:
    raise TypeError(
      f"no published checkpoint layout for {type(drafter).__name__}; save a draft "
      f"model with jaxspec.save_hf"
    )


def make_drafter(
  method: str,
  target: TargetModel,
  *,
  gamma: int = 4,
  draft_dir: Optional[str] = None,
  ngram_n: int = 3,
  block_size: Optional[int] = None,
) -> Optional[Drafter]:
  """The drafter for a method name; None for plain decoding.

  `gamma` sets the chain length of draft_model / ngram / mtp / eagle3; a DFlash drafter drafts
  block_size − 1 tokens (block_size defaults to the checkpoint's).
  """
  if method == "plain":
    return None
  if method == "ngram":
    return NgramDrafter(gamma=gamma, n=ngram_n)
  if method == "mtp":
    return MTPDrafter.from_target(target, gamma=gamma)
  if method in ("draft_model", "dflash", "eagle3"):
    if not draft_dir:
      raise ValueError(f"method {method!r} needs a drafter checkpoint directory")
    kind = checkpoint_kind(draft_dir)
    if kind != method:
      raise InputError(f"method {method!r} but {draft_dir} holds a {kind} checkpoint")
    if method == "dflash":
      return load_drafter(draft_dir, target, gamma=(block_size - 1) if block_size else None)
    return load_drafter(draft_dir, target, gamma)
  raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
