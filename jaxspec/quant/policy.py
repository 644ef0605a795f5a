"""Quantizing a target by policy: an ordered list of rules, each a pattern and a format.

A rule's pattern matches a weight's role or its parameter path; the first matching rule
decides the weight's format ("mxfp4", "fp8" or "none"), and a weight no rule matches stays as
it is. Roles, from the parameter tree:

  experts          routed expert matrices (gate_proj / up_proj / down_proj of MoE layers;
                   gpt-oss's fused gate_up_proj)
  shared_experts   the always-on shared experts of MoE layers
  mlp              dense feed-forward layers
  attention        q / k / v / o projections; MLA's q_a_proj, q_b_proj, kv_a_proj_with_mqa,
                   kv_b_proj (its latent norms are norms)
  router           MoE router weights (float32, as HF keeps them)
  lm_head          the LM head (a tied one becomes its own weight, a copy of the embedding's
                   transpose, so that the head is read in the rule's format while token
                   lookups keep the float embedding: as llama.cpp quantizes a tied output)
  mtp              everything in the MTP layers
  embed, norm, bias   never quantized (bias includes gpt-oss's attention sinks)

A pattern "role@N" matches that role in layer N only (per-layer policies, as the sensitivity
profiler writes them; they need the per-layer layout, `scan_layers=False`). A path pattern is
an fnmatch pattern over "/"-joined parameter paths, e.g. "layers_1/*/mlp/gate_proj". The default policy is MiMo-V2.5-Pro × TileRT's: experts MXFP4,
attention and router FP8, everything else unquantized (the router stays float for targets whose
published checkpoints keep it so: `default_policy`).

A policy is a plain tuple of (pattern, format) pairs, or an ml_collections ConfigDict with a
`rules` field holding them (`policy_from_config`), so launch scripts can take it from a config
file.
"""

from __future__ import annotations

import dataclasses
import json
import fnmatch
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np

from jaxspec.errors import ConfigError
from jaxspec.quant.formats import FORMATS, QTensor, nbytes, quantize_weight

ROLES = (
  "experts",
  "shared_experts",
  "mlp",
  "attention",
  "router",
  "lm_head",
  "mtp",
  "embed",
  "norm",
  "bias",
)
NEVER = ("embed", "norm", "bias")
DEFAULT_POLICY = (("experts", "mxfp4"), ("attention", "fp8"), ("router", "fp8"))
_LINEAR = ("experts", "shared_experts", "mlp", "attention", "router", "lm_head", "mtp")
# Policies by name (`load_policy`): "fp8" and "mxfp4" put every linear layer in that format
# (llama.cpp's whole-model Q8_0 / Q4_0 counterparts, as the llama.cpp race compares them).
NAMED_POLICIES = {
  "default": DEFAULT_POLICY,
  "none": (),
  "fp8": tuple((role, "fp8") for role in _LINEAR),
  "mxfp4": tuple((role, "mxfp4") for role in _LINEAR),
}

# Logical axes a weight may have in front of its matrix: a stack of layers, or of experts.
_LEADING = ("layers", "expert")
# MLA's low-rank latents: the input of q_b_proj [q_lora, heads, head_dim] and of kv_b_proj
# [kv_lora, heads, head_dim], weights that never see the "embed" axis.
_LATENT_INPUTS = ("q_lora", "kv_lora")


def path_str(path: tuple) -> str:
  """A tree path as "/"-joined keys (`layers_1/0/mlp/gate_proj`)."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def role_of(path: str) -> str:
  """The role of the weight at a "/"-joined parameter path (see the module docstring)."""
  parts = path.split("/")
  leaf = parts[-1]
  if leaf in ("bias", "e_score_correction_bias") or leaf.endswith("_bias"):
    return "bias"
  if leaf == "scale":
    return "norm"
  if parts[0] in ("embed", "embed_per_layer") or leaf == "embed":
    return "embed"  # (Gemma 4's per-layer input table is an embedding too)
  if parts[0].startswith("mtp_"):
    return "mtp"
  if parts[0] == "lm_head":
    return "lm_head"
  if leaf == "sinks":
    return "bias"  # one logit per head (gpt-oss, MiMo), not an attention projection
  if "self_attn" in parts:
    return "attention"
  if "shared_experts" in parts:
    return "shared_experts"
  if leaf in ("router_scale", "per_expert_scale", "layer_scalar"):
    return "norm"  # learned scales (Gemma 4), never quantized
  if leaf == "router":
    return "router"
  experts = "mlp" in parts or "moe" in parts  # (Gemma 4's experts sit beside its MLP, in "moe")
  if leaf in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") and experts:
    return "experts"
  return "mlp"


def contraction_axes(axes: tuple) -> tuple[int, ...]:
  """A weight's contraction axes, as negative indices, from its logical axis names: "embed"
  when it comes first in the matrix (an input projection), else every axis before "embed"
  (an output projection: o_proj contracts heads and head_dim, down_proj contracts mlp); an
  MLA up-projection without "embed" contracts its leading latent axis."""
  names = list(axes)
  n = len(names)
  lead = 0
  while lead < n and names[lead] in _LEADING:
    lead += 1
  matrix = names[lead:]
  if "embed" not in matrix and matrix and matrix[0] in _LATENT_INPUTS:
    return (lead - n,)
  if "embed" not in matrix:
    raise ConfigError(f"cannot tell the contraction axes of a weight with axes {axes}")
  at = matrix.index("embed")
  idx = [lead] if at == 0 else list(range(lead, lead + at))
  return tuple(i - n for i in idx)


def _is_path_pattern(pattern: str) -> bool:
  return "/" in pattern or any(c in pattern for c in "*?[")


def _split_layer(pattern: str) -> tuple[str, Optional[int]]:
  """ "experts@3" → ("experts", 3); "experts" → ("experts", None)."""
  if "@" not in pattern or _is_path_pattern(pattern):
    return pattern, None
  role, _, layer = pattern.partition("@")
  if not layer.isdigit():
    raise ConfigError(f"rule {pattern!r}: the layer after '@' must be a number")
  return role, int(layer)


def layer_of(config: Any, path: str) -> Optional[int]:
  """The model layer a per-layer parameter path belongs to (`layers_{s}/{j}/...`), None for
  weights outside the layer stack; -1 for a stacked run (the scanned layout)."""
  parts = path.split("/")
  if not parts[0].startswith("layers_"):
    return None
  if len(parts) < 2 or not parts[1].isdigit():
    return -1
  first, _, _ = config.segments()[int(parts[0][len("layers_") :])]
  return first + int(parts[1])


def check_policy(policy: Iterable) -> tuple[tuple[str, str], ...]:
  """Validates a policy: (pattern, format) pairs with a known role (optionally "@layer") or
  a path pattern."""
  rules = []
  for rule in policy:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
      raise ConfigError(f"a policy rule is a (pattern, format) pair, got {rule!r}")
    pattern, fmt = str(rule[0]), str(rule[1])
    if fmt not in (*FORMATS, "none"):
      raise ConfigError(f"rule {pattern!r}: unknown format {fmt!r}; expected {FORMATS} or 'none'")
    role, _ = _split_layer(pattern)
    if role in NEVER and fmt != "none":
      raise ConfigError(f"rule {pattern!r}: {role} weights are never quantized")
    if not _is_path_pattern(pattern) and role not in ROLES:
      raise ConfigError(
        f"rule {pattern!r} matches no role ({', '.join(ROLES)}) and is not a path pattern"
      )
    rules.append((pattern, fmt))
  return tuple(rules)


def policy_from_config(config: Any) -> tuple[tuple[str, str], ...]:
  """A policy from an ml_collections ConfigDict (or dict) with `rules`, or a rule list."""
  rules = config.get("rules") if hasattr(config, "get") else config
  if rules is None:
    raise ConfigError("a quantization policy config needs a `rules` list of (pattern, format)")
  return check_policy(rules)


def format_for(path: str, policy: tuple[tuple[str, str], ...], config: Any = None) -> str:
  """The format the first matching rule gives the weight at `path` ("none" if no rule does)."""
  role = role_of(path)
  if role in NEVER:
    return "none"
  for pattern, fmt in policy:
    if _is_path_pattern(pattern):
      if fnmatch.fnmatchcase(path, pattern):
        return fmt
      continue
    rule_role, layer = _split_layer(pattern)
    if rule_role != role:
      continue
    if layer is None:
      return fmt
    at = layer_of(config, path) if config is not None else None
    if at == -1:
      raise ConfigError(
        f"rule {pattern!r} names one layer, but {path} stacks every layer of its run: load "
        f"the model with scan_layers=False for per-layer policies"
      )
    if at == layer:
      return fmt
  return "none"


@dataclasses.dataclass(frozen=True)
class QuantReport:
  """What quantizing did: the format of each weight and the bytes before and after."""

  formats: dict
  bytes_before: int
  bytes_after: int
  policy: tuple = ()


def bytes_by_format(params: Any) -> dict:
  """Stored bytes of a parameter tree per weight format ("none" for plain arrays)."""
  out: dict = {}
  for leaf in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QTensor)):
    fmt = leaf.format if isinstance(leaf, QTensor) else "none"
    out[fmt] = out.get(fmt, 0) + nbytes(leaf)
  return out


def quantize_params(
  params: Any, logical_axes: Any, policy: Iterable = DEFAULT_POLICY, config: Any = None
) -> tuple[Any, QuantReport]:
  """The parameter tree with each weight in its policy's format (QTensor leaves)."""
  rules = check_policy(policy)
  axes_of = {
    path_str(p): tuple(spec)
    for p, spec in jax.tree_util.tree_flatten_with_path(
      logical_axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )[0]
  }
  formats, before, after = {}, 0, 0

  def convert(path, leaf):
    nonlocal before, after
    name = path_str(path)
    fmt = format_for(name, rules, config)
    before += nbytes(leaf)
    if fmt == "none":
      after += nbytes(leaf)
      return leaf
    axes = axes_of.get(name)
    if axes is None:
      raise ConfigError(f"no logical axes for {name}")
    try:
      q = quantize_weight(np.asarray(leaf), fmt, contraction_axes(axes))
    except ConfigError as e:
      raise ConfigError(f"{name} ({fmt}): {e}") from None
    formats[name] = fmt
    after += q.nbytes
    return q

  out = jax.tree_util.tree_map_with_path(convert, params)
  return out, QuantReport(formats, before, after, rules)


def default_policy(config: Any = None) -> tuple[tuple[str, str], ...]:
  """The policy `quantize` applies when given none: DEFAULT_POLICY, without the router rule
  for the families whose published checkpoints keep the router float (`Family.float_router`:
  MiMo-V2-Flash, whose transformers class keeps it in fp32, and MiniMax-M2, whose FP8 release
  leaves it unconverted); an explicit policy may still quantize it."""
  family = getattr(config, "family", None)
  if family is not None and family.float_router:
    return tuple(rule for rule in DEFAULT_POLICY if rule[0] != "router")
  return DEFAULT_POLICY


def quantize(target: Any, policy: Optional[Iterable] = None) -> Any:
  """`target` with its weights quantized by `policy` (default: `default_policy(config)`).

  The returned model keeps its weights in their formats (no dequantized copy); every forward
  dequantizes what it reads. Its `quant_report` says what was quantized and the bytes saved.
  """
  policy = default_policy(target.config) if policy is None else policy
  if target.config.tie_word_embeddings and format_for(
    "lm_head/kernel", check_policy(policy), target.config
  ) != "none":
    target = untie_head(target)
  axes = target.logical_axes()
  params, report = quantize_params(target.params, axes, policy, target.config)
  return dataclasses.replace(target, params=params, quant_report=report)


def untie_head(target: Any) -> Any:
  """A tied target with its LM head as a weight of its own (the embedding transposed, [H, V]):
  the same logits, and a head a policy can quantize apart from the embedding."""
  embed = target.params["embed"]
  params = dict(target.params, lm_head={"kernel": np.asarray(embed).T.copy()})
  config = target.config.replace(tie_word_embeddings=False)
  return dataclasses.replace(target, config=config, params=params)


def load_policy(spec: str) -> tuple[tuple[str, str], ...]:
  """A policy by name (NAMED_POLICIES: "default", "none", "fp8", "mxfp4") or from a JSON file
  holding {"rules": [...]}."""
  if spec in NAMED_POLICIES:
    return NAMED_POLICIES[spec]
  try:
    with open(spec) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise ConfigError(
      f"quantization policy {spec!r} is neither one of {sorted(NAMED_POLICIES)} nor a JSON file"
    ) from None
  except json.JSONDecodeError as e:
    raise ConfigError(f"quantization policy file {spec} is not JSON: {e}") from None
  return policy_from_config(data)


def save_policy(rules: Sequence, path: str, **info: Any) -> None:
  with open(path, "w") as f:
    json.dump({"rules": [list(r) for r in check_policy(rules)], **info}, f, indent=1)
