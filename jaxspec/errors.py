"""The errors jaxspec raises for bad input, one hierarchy for users to catch.

`JaxspecError` is the base; each subclass is also a `ValueError`, so code written against the
earlier `ValueError`s keeps working.
"""

from __future__ import annotations


class JaxspecError(Exception):
  """Base of every error jaxspec raises for a problem in what it was given."""


class ConfigError(JaxspecError, ValueError):
  """A configuration that jaxspec cannot run faithfully."""


class InputError(JaxspecError, ValueError):
  """Bad input to a model or engine call (ids outside the vocabulary, too long, ...)."""


class CheckpointError(JaxspecError, ValueError):
  """A checkpoint that is missing, truncated, incomplete or inconsistent with its config."""
