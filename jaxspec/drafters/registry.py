"""Building drafters by name or from a checkpoint directory (`jaxspec.load_drafter`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from jaxspec.drafters import dflash, eagle3, gemma4_assistant
from jaxspec.drafters.base import Drafter
from jaxspec.errors import ConfigError
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.io import drafter_ckpt, gguf, hub
from jaxspec.io import hf as hf_io, tree_acceptance
from jaxspec.models.target import InputError, TargetModel

# Drafts per step of the chain drafters when none is given.
DEFAULT_GAMMA = 4

METHODS = ("plain", "draft_model", "ngram", "mtp", "dflash", "eagle3", "gemma4_assistant")
# Methods whose drafter is read from a checkpoint directory, and take drafter options.
CHECKPOINT_METHODS = ("draft_model", "dflash", "eagle3", "gemma4_assistant")
# A drafter repository's files: a checkpoint's, and EAGLE-3 heads' pytorch_model.bin (yuhuili).
DRAFTER_PATTERNS = (*hub.CHECKPOINT_PATTERNS, "*.bin")
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def bundled_dir(name: str) -> Optional[str]:
  """jaxspec/assets/<name> ("target", "draft", "dflash", "eagle3") if it holds a checkpoint."""
  path = os.path.join(ASSETS_DIR, name)
  return path if os.path.exists(os.path.join(path, "config.json")) else None


def checkpoint_kind(path: str) -> str:
  """'dflash', 'eagle3', 'gemma4_assistant' or 'draft_model' for a drafter checkpoint
  directory, hub id or GGUF file (a draft model)."""
  path = hub.resolve(path, DRAFTER_PATTERNS)
  if gguf.is_gguf(path) and os.path.isfile(path):
    return "draft_model"
  if not os.path.isdir(path):
    raise hf_io.CheckpointError(f"drafter directory {path!r} does not exist")
  kind = drafter_ckpt.detect_kind(hf_io.read_config(path))
  return "draft_model" if kind == "causal_lm" else kind


def load_drafter(
  path: str, target: TargetModel, gamma: Optional[int] = None, **kwargs: Any
) -> Drafter:
  """Loads the drafter stored in `path` for `target`, whichever layout config.json names.

  DFlash (`DFlashDraftModel`), EAGLE-3 (`LlamaForCausalLMEagle3`) and Gemma 4 assistant
  (`Gemma4AssistantForCausalLM`) checkpoints load in their published layouts; anything else
  must be an HF causal LM (a draft model). `gamma` is the
  number of draft tokens per step (None: 4 for chains, block_size − 1 for DFlash, which
  refuses more); `kwargs` go to the drafter (e.g. sample_drafts, context_window). A measured
  tree acceptance model beside the checkpoint (`tree_acceptance.json`) comes with it. `path`
  may be a hub id (`org/name`: huggingface_hub's cache) or, for a draft model, a GGUF file.
  """
  path = hub.resolve(path, DRAFTER_PATTERNS)
  drafter = _load(path, target, gamma, **kwargs)
  return dataclasses.replace(drafter, tree_acceptance=tree_acceptance.read(path))


def _load(path: str, target: TargetModel, gamma: Optional[int], **kwargs: Any) -> Drafter:
  kind = checkpoint_kind(path)
  if kind == "dflash":
    return dflash.load_dflash(path, target, gamma=gamma, **kwargs)
  chain_gamma = DEFAULT_GAMMA if gamma is None else gamma
  if kind == "eagle3":
    return eagle3.load_eagle3(path, target, gamma=chain_gamma, **kwargs)
  if kind == "gemma4_assistant":
    return gemma4_assistant.load_assistant(path, target, gamma=chain_gamma, **kwargs)
  model = hf_io.load_model(path, scan_layers=False)  # a draft model decodes
  if model.config.vocab_size != target.config.vocab_size:
    raise InputError(
      f"drafter vocabulary ({model.config.vocab_size}) differs from the target's "
      f"({target.config.vocab_size})"
    )
  if kwargs:
    raise ConfigError(f"a draft model takes no drafter options, got {sorted(kwargs)}")
  return DraftModelDrafter.from_model(model, gamma=chain_gamma)


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
  gamma: Optional[int] = None,
  draft_dir: Optional[str] = None,
  ngram_n: int = 3,
  block_size: Optional[int] = None,
  **options: Any,
) -> Optional[Drafter]:
  """The drafter for a method name; None for plain decoding.

  `gamma`: drafts per step; None = the method's default (DEFAULT_GAMMA for chains; DFlash drafts
  its trained block_size − 1 and accepts any shorter γ). `block_size` (DFlash only) is the
  block length γ + 1, an alternative to `gamma`. `options` go to a checkpoint drafter (DFlash,
  EAGLE-3: e.g. context_window, sample_drafts).
  """
  if options and method not in ("dflash", "eagle3", "gemma4_assistant"):
    raise ConfigError(f"method {method!r} takes no drafter options, got {sorted(options)}")
  if block_size is not None:
    if method != "dflash":
      raise ConfigError(f"block_size applies to DFlash only, not method {method!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
      raise ConfigError(f"DFlash block_size (γ + 1) must be an integer ≥ 2, got {block_size!r}")
    if gamma is not None and gamma != block_size - 1:
      raise ConfigError(
        f"gamma={gamma} and block_size={block_size} disagree (a DFlash block is γ + 1 tokens)"
      )
    gamma = block_size - 1
  if method == "plain":
    return None
  chain_gamma = DEFAULT_GAMMA if gamma is None else gamma
  if method == "ngram":
    return NgramDrafter(gamma=chain_gamma, n=ngram_n)
  if method == "mtp":
    return MTPDrafter.from_target(target, gamma=chain_gamma)
  if method in CHECKPOINT_METHODS:
    if not draft_dir:
      raise ConfigError(f"method {method!r} needs a drafter checkpoint directory")
    kind = checkpoint_kind(draft_dir)
    if kind != method:
      raise InputError(f"method {method!r} but {draft_dir} holds a {kind} checkpoint")
    return load_drafter(draft_dir, target, gamma, **options)
  raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
