"""jaxspec: lossless speculative decoding for large language models in JAX.

The public API (see docs/ and DESIGN.md): load a target model from a Hugging Face directory,
build an engine, generate.
"""

from jaxspec.cache import KVCache
from jaxspec.config import ConfigError, MeshConfig, ModelConfig
from jaxspec.io.hf import CheckpointError, load_model, save_hf
from jaxspec.models.target import InputError, TargetModel

__all__ = [
    "CheckpointError", "ConfigError", "InputError", "KVCache", "MeshConfig", "ModelConfig",
    "TargetModel", "load_model", "save_hf",
]
