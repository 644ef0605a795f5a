"""Named ml_collections configurations, one module per setup.

Each module defines ``get_config() -> ml_collections.ConfigDict``. Launch
scripts load them by path with ``config_flags`` (``--config
configs/tiny_random.py``); notebooks can use ``configs.get('tiny_random')``.
"""

from __future__ import annotations

import importlib

import ml_collections


def get(name: str) -> ml_collections.ConfigDict:
  """Returns ``configs/<name>.py``'s ``get_config()``."""
  try:
    module = importlib.import_module(f"{__name__}.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"{__name__}.{name}":
      raise
    raise ValueError(f"no config named {name!r} in {__name__}/") from None
  return module.get_config()
