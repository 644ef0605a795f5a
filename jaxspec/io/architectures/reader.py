"""Typed reads of a Hugging Face `config.json` dict, shared by every architecture mapping.

Targets (jaxspec/io/architectures/) and drafter checkpoints (io/drafter_ckpt.py) read their
config.json through `HFConfigReader`, so a bad field is always a ConfigError naming it, never a
silent coercion.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from jaxspec.errors import ConfigError, is_int, is_real, show

# The layer types of HF configs' `layer_types` that mix windowed and full attention.
SLIDING, FULL = "sliding_attention", "full_attention"

# The default of a field that has none: reading it absent raises (`HFConfigReader.require`).
REQUIRED = object()


class HFConfigReader:
  """Typed reads of one HF `config.json` dict: every bad field is a ConfigError naming it.

  A field that is absent or null takes its default (HF's convention for optional fields); with
  no default it is required, and `require` names every missing one at once. Integers must be
  JSON integers (not booleans, not 64.0), floats finite numbers, booleans JSON booleans, so
  that nothing is silently truncated or coerced (`bool("false")` is True). `what` prefixes the
  messages (the architecture or drafter kind).
  """

  def __init__(self, hf: Mapping[str, Any], what: str):
    if not isinstance(hf, Mapping):
      raise ConfigError(f"{what}: config.json must hold a JSON object, got {type(hf).__name__}")
    self.hf = hf
    self.what = what
    self._rope_sources: list[tuple[str, Mapping[str, Any]]] = []  # set by `rope`

  def error(self, msg: str) -> ConfigError:
    return ConfigError(f"{self.what}: {msg}")

  def has(self, key: str) -> bool:
    return self.hf.get(key) is not None

  def require(self, *keys: str) -> None:
    """Raises ConfigError naming the keys that are absent or null."""
    absent = [k for k in keys if k not in self.hf]
    null = [k for k in keys if k in self.hf and self.hf[k] is None]
    parts = []
    if absent:
      parts.append(f"missing required field(s): {', '.join(absent)}")
    if null:
      parts.append(f"null required field(s): {', '.join(f'{k}=null' for k in null)}")
    if parts:
      raise self.error("; ".join(parts))

  def _value(self, key: str, default: Any) -> Any:
    if self.hf.get(key) is not None:
      return self.hf[key]
    if default is REQUIRED:
      self.require(key)
    return default

  def integer(self, key: str, default: Any = REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not is_int(v):
      raise self.error(f"{key} must be an integer, got {show(v)}")
    return int(v)

  def first_integer(self, keys: Sequence[str], default: Any = REQUIRED) -> Any:
    """The integer under the first of `keys` that is set (HF's aliases, e.g. num_experts)."""
    for key in keys:
      if self.has(key):
        return self.integer(key)
    return self.integer(keys[0], default)

  def number(self, key: str, default: Any = REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not is_real(v) or not math.isfinite(v):
      raise self.error(f"{key} must be a finite number, got {show(v)}")
    return float(v)

  def flag(self, key: str, default: Any = REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, bool):
      raise self.error(f"{key} must be true or false, got {show(v)}")
    return v

  def string(self, key: str, default: Any = REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, str):
      raise self.error(f"{key} must be a string, got {show(v)}")
    return v

  def integers(self, key: str, default: Any = REQUIRED, scalar_ok: bool = False) -> Any:
    """A list of integers as a tuple (with `scalar_ok`, a lone integer too, as eos_token_id)."""
    v = self._value(key, default)
    if v is default:
      return v
    if scalar_ok and is_int(v):
      return (int(v),)
    if not isinstance(v, (list, tuple)) or not all(is_int(x) for x in v):
      kind = "an integer or a list of integers" if scalar_ok else "a list of integers"
      raise self.error(f"{key} must be {kind}, got {show(v)}")
    return tuple(int(x) for x in v)

  def strings(self, key: str, default: Any = REQUIRED) -> Any:
    v = self._value(key, default)
    if v is default:
      return v
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
      raise self.error(f"{key} must be a list of strings, got {show(v)}")
    return tuple(v)

  def mapping(self, key: str) -> dict:
    """The JSON object under `key` as a dict ({} when absent or null)."""
    v = self._value(key, None)
    if v is None:
      return {}
    if not isinstance(v, Mapping):
      raise self.error(f"{key} must be a JSON object, got {show(v)}")
    return dict(v)

  def rope_per_layer_type(self) -> dict[str, Mapping[str, Any]]:
    """transformers 5's `rope_parameters` nested per layer type ({} when absent): refused when
    flat or naming a layer type other than sliding_attention and full_attention."""
    params = self.mapping("rope_parameters")
    nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
    if params and len(nested) != len(params):
      raise self.error(f"rope_parameters must be nested per layer type ({SLIDING}, {FULL})")
    extra = sorted(set(nested) - {SLIDING, FULL})
    if extra:
      raise self.error(f"rope_parameters names unknown layer types {extra}")
    return nested

  def rope(
    self,
    default_theta: float = 10000.0,
    default_partial: float | None = None,
    allowed: tuple[str, ...] = ("default",),
  ) -> tuple[float, float | None]:
    """(rope_theta, partial_rotary_factor) of a config whose RoPE types are all `allowed`.

    transformers reads RoPE from `rope_parameters` (v5), the legacy `rope_scaling` (which it
    prefers when both are set) and the top-level `rope_theta` / `partial_rotary_factor` (used
    where the dict lacks them); a dict may also be nested per layer type. A type not in
    `allowed` in any of these places raises, naming it (the scaling itself is read by
    `rope_scaling`); and a setting given twice with different values raises too, since whichever a reader picks, the
    other was meant. `default_partial` None means the architecture ignores the factor (Qwen3),
    so it is neither read nor checked and None is returned.
    """
    sources: list[tuple[str, Mapping[str, Any]]] = []
    for key in ("rope_parameters", "rope_scaling"):
      d = self.mapping(key)
      nested = {k: v for k, v in d.items() if isinstance(v, Mapping)}
      if nested and len(nested) != len(d):
        raise self.error(f"{key} mixes per-layer-type entries {sorted(nested)} with flat ones")
      if nested:
        sources += [(f"{key}.{k}", v) for k, v in nested.items()]
      elif d:
        sources.append((key, d))
    self._rope_sources = sources
    for label, d in sources:
      rope_type = d.get("rope_type") or d.get("type") or "default"
      if rope_type not in allowed:
        raise self.error(
          f"RoPE type {show(rope_type)} in {label} is not supported "
          f"({', '.join(repr(a) for a in allowed)})"
        )

    def setting(name: str, default: float) -> float:
      found = [(f"{label}.{name}", d[name]) for label, d in sources if d.get(name) is not None]
      if self.has(name):
        found.append((name, self.hf[name]))
      for label, v in found:
        if not is_real(v) or not math.isfinite(v):
          raise self.error(f"{label} must be a finite number, got {show(v)}")
      if len({float(v) for _, v in found}) > 1:
        raise self.error(f"conflicting {name}: {', '.join(f'{label}={v}' for label, v in found)}")
      return float(found[0][1]) if found else default

    theta = setting("rope_theta", default_theta)
    if not theta > 0:
      raise self.error(f"rope_theta must be positive, got {theta}")
    if default_partial is None:
      return theta, None
    partial = setting("partial_rotary_factor", default_partial)
    if not 0 < partial <= 1:
      raise self.error(f"partial_rotary_factor must be in (0, 1], got {partial}")
    return theta, partial

  def rope_scaling(self, max_position_embeddings: int) -> tuple[tuple[str, Any], ...]:
    """The RoPE scaling settings (after `rope`), normalized: () for the default RoPE, else
    sorted (name, value) pairs of "linear" (factor), "dynamic" (factor,
    max_position_embeddings), "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or "yarn" (factor, original_max_position_embeddings,
    beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate), with
    transformers' defaults filled in. Every place the config
    states a scaling must state the same one."""
    found = {}
    for label, d in self._rope_sources:
      rope_type = d.get("rope_type") or d.get("type") or "default"
      if rope_type == "default":
        continue
      found[label] = self._normalized_scaling(label, rope_type, d, max_position_embeddings)
    if len(set(found.values())) > 1:
      raise self.error(f"conflicting RoPE scaling: {found}")
    return next(iter(found.values()), ())

  def _normalized_scaling(
    self, label: str, rope_type: str, d: Mapping[str, Any], max_position_embeddings: int
  ) -> tuple[tuple[str, Any], ...]:
    def number(name: str, default: Any, positive: bool = True) -> Any:
      v = d.get(name)
      if v is None:
        return default
      if not is_real(v) or not math.isfinite(v) or (positive and not v > 0):
        raise self.error(f"{label}.{name} must be a finite positive number, got {show(v)}")
      return float(v)

    if rope_type in ("linear", "dynamic"):
      factor = number("factor", None)
      if factor is None:
        raise self.error(f"{label}: {rope_type} RoPE scaling needs a factor")
      if rope_type == "linear":
        return (("factor", factor), ("rope_type", "linear"))
      # Dynamic NTK: the base for the whole extended context, max_position_embeddings × factor.
      length = int(max_position_embeddings)
      return (("factor", factor), ("max_position_embeddings", length), ("rope_type", "dynamic"))
    if rope_type == "llama3":  # factor and both band factors required, as transformers
      missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if d.get(k) is None]
      if missing:
        raise self.error(f"{label}: llama3 RoPE scaling needs {', '.join(missing)}")
      low, high = number("low_freq_factor", None), number("high_freq_factor", None)
      if not high > low:  # else the blend between the two wavelengths is undefined
        raise self.error(
          f"{label}: llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
          f"{high} and {low}"
        )
      original = d.get("original_max_position_embeddings")
      if original is None:  # transformers' fallback
        original = max_position_embeddings
      if not is_int(original) or original < 1:
        raise self.error(
          f"{label}.original_max_position_embeddings must be a positive integer, got "
          f"{show(original)}"
        )
      return (
        ("factor", number("factor", None)),
        ("high_freq_factor", high),
        ("low_freq_factor", low),
        ("original_max_position_embeddings", int(original)),
        ("rope_type", "llama3"),
      )
    original = d.get("original_max_position_embeddings")
    if not is_int(original) or original < 1:
      raise self.error(
        f"{label}: yarn RoPE scaling needs original_max_position_embeddings, got {show(original)}"
      )
    factor = number("factor", None)
    if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
      factor = max_position_embeddings / original
    truncate = d.get("truncate", True)
    if not isinstance(truncate, bool):
      raise self.error(f"{label}.truncate must be a bool, got {show(truncate)}")
    return tuple(
      sorted(
        {
          "rope_type": "yarn",
          "factor": factor,
          "original_max_position_embeddings": int(original),
          "beta_fast": number("beta_fast", 32.0),
          "beta_slow": number("beta_slow", 1.0),
          "attention_factor": number("attention_factor", None),
          "mscale": number("mscale", None, positive=False),
          "mscale_all_dim": number("mscale_all_dim", None, positive=False),
          "truncate": truncate,
        }.items()
      )
    )

