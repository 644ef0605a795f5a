"""The errors jaxspec raises for bad input, one hierarchy for users to catch.

`JaxspecError` is the base; each subclass is also a `ValueError`, so code written against the
earlier `ValueError`s keeps working.
"""

from __future__ import annotations

import numbers


class JaxspecError(Exception):
  """Base of every error jaxspec raises for a problem in what it was given."""


class ConfigError(JaxspecError, ValueError):
  """A configuration that jaxspec cannot run faithfully."""


class InputError(JaxspecError, ValueError):
  """Bad input to a model or engine call (ids outside the vocabulary, too long, ...).

  `param`, when known, names the argument at fault as the engine's calls name it ("prompt",
  "max_new_tokens", "top_p", ...), so that a server's error body can name the field.
  """

  def __init__(self, message: str = "", param: str | None = None):
    super().__init__(message)
    self.param = param


class CheckpointError(JaxspecError, ValueError):
  """A checkpoint that is missing, truncated, incomplete or inconsistent with its config."""


# Value checks shared by the config, the run options and the config.json readers, so that every
# message about a bad value reads the same way.


def is_int(v: object) -> bool:
  """A true integer: not a bool (JSON's `true` is no count), not 64.0."""
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: object) -> bool:
  """An int or float that is not a bool."""
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


def show(v: object) -> str:
  """`repr(v)` cut to 60 characters, for error messages."""
  text = repr(v)
  return text if len(text) <= 60 else text[:57] + "..."
