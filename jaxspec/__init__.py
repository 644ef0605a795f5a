"""jaxspec: lossless speculative decoding for large language models in JAX.

The public API (see README.md and docs/): load a target model from a Hugging Face directory,
build an engine, generate.
"""

from jaxspec.state import DecodingState, FloatKV, FP8KV
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.drafters.ngram import NgramDrafter
from jaxspec.drafters.dflash import DFlashConfig, DFlashDrafter
from jaxspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.drafters.registry import load_drafter, make_drafter, save_drafter
from jaxspec.config import ModelConfig
from jaxspec.sharding import MeshConfig
from jaxspec.options import RunOptions
from jaxspec.errors import CheckpointError, ConfigError, InputError, JaxspecError
from jaxspec.io.hf import load_model, save_hf
from jaxspec.models.target import TargetModel
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.speculative.request import Request, SamplingArgs
from jaxspec.quant import quantize

__all__ = [
  "CheckpointError",
  "ConfigError",
  "DFlashConfig",
  "DFlashDrafter",
  "DraftModelDrafter",
  "Drafter",
  "Eagle3Config",
  "Eagle3Drafter",
  "EngineConfig",
  "InputError",
  "JaxspecError",
  "DecodingState",
  "FP8KV",
  "FloatKV",
  "MTPDrafter",
  "MeshConfig",
  "ModelConfig",
  "NgramDrafter",
  "Request",
  "RunOptions",
  "SamplingArgs",
  "SpecEngine",
  "TargetModel",
  "load_drafter",
  "load_model",
  "make_drafter",
  "quantize",
  "save_drafter",
  "save_hf",
]
