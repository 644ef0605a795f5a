"""`TargetModel`: a config, its parameters and (optionally) a tokenizer, with jitted forwards.

The forward is a pure function of (params, tokens, start, decoding state); `TargetModel` only
bundles what belongs together so that notebooks can write `model.logits(ids)` and launch scripts can pass
`model.params` and `model.config` into jitted engines.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import InputError
from jaxspec.options import RunOptions
from jaxspec.quant.formats import stored_logical_axes
from jaxspec.models.decoder import (
  Decoder,
  DecoderOutput,
  stack_layer_params,
  unstack_layer_params,
)
from jaxspec.state import DecodingState


@functools.partial(
  jax.jit, static_argnames=("config", "taps", "last_only"), donate_argnames=("state",)
)
def _forward(
  config: ModelConfig,
  params: Any,
  tokens: jax.Array,
  start: jax.Array | None = None,
  state: DecodingState | None = None,
  positions: jax.Array | None = None,
  block_mask: jax.Array | None = None,
  taps: tuple[int, ...] = (),
  last_only: bool = False,
) -> DecoderOutput:
  return Decoder(config).apply(
    {"params": params}, tokens, start, state, positions, block_mask, taps, last_only
  )


def forward(
  config: ModelConfig,
  params: Any,
  tokens: jax.Array,
  start: jax.Array | None = None,
  state: DecodingState | None = None,
  **options: Any,
) -> DecoderOutput:
  """One jitted block forward (prefill, decode or verify) with the decoding state donated.

  `options` are `_forward`'s (positions, block_mask, taps, last_only). `start` may be the
  state's own `lengths` (the usual decode call): it is copied first, since a donated buffer
  cannot also be passed as another argument.
  """
  if state is not None and start is not None and start is state.lengths:
    start = jnp.copy(start)
  return _forward(config, params, tokens, start, state, **options)


def apply_decoder(config: ModelConfig, params: Any, *args, **kwargs) -> DecoderOutput:
  """The un-jitted forward, for use inside other jitted functions (engines, trainers)."""
  return Decoder(config).apply({"params": params}, *args, **kwargs)


def apply_mtp(config: ModelConfig, params: Any, *args, **kwargs):
  """MTP layer forward (see Decoder.mtp_forward), un-jitted."""
  return Decoder(config).apply({"params": params}, *args, method=Decoder.mtp_forward, **kwargs)


@functools.lru_cache(maxsize=64)
def _init_fn(config: ModelConfig):
  """A jitted initialiser per config (cached: re-tracing a model costs seconds on CPU)."""
  return jax.jit(
    lambda key: Decoder(config).init(key, jnp.zeros((1, 1), jnp.int32), method=Decoder.init_all)
  )


@functools.lru_cache(maxsize=64)
def _abstract_variables(config: ModelConfig) -> Any:
  return jax.eval_shape(_init_fn(config), jax.random.PRNGKey(0))


def init_params(config: ModelConfig, seed: int = 0) -> Any:
  """Random parameters (normal(0.02) matrices, unit norms), unboxed."""
  return nn.meta.unbox(_init_fn(config)(jax.random.PRNGKey(seed))["params"])


def logical_axes(config: ModelConfig) -> Any:
  """Tree of logical PartitionSpecs matching the parameter tree."""
  return nn.get_partition_spec(_abstract_variables(config))["params"]


def params_logical_axes(config: ModelConfig, params: Any) -> Any:
  """Logical PartitionSpecs of `params` as stored: `logical_axes(config)`, with each quantized
  weight's values and scales named after the weight (jaxspec.quant.formats.stored_axes)."""
  return stored_logical_axes(params, logical_axes(config))


def param_shapes(config: ModelConfig) -> Any:
  """Tree of jax.ShapeDtypeStruct matching the parameter tree."""
  return nn.meta.unbox(_abstract_variables(config)["params"])


@dataclasses.dataclass
class TargetModel:
  """A loaded target model: config, parameters, tokenizer and the HF config it came from."""

  config: ModelConfig
  params: Any
  tokenizer: Any = None
  hf_config: dict | None = None
  # What jaxspec.quant.quantize did to the weights (None: not quantized).
  quant_report: Any = None

  @classmethod
  def random(cls, config: ModelConfig, seed: int = 0, tokenizer: Any = None) -> "TargetModel":
    """Random weights in the layout `config.options.scan_layers` says (engines decode it per
    layer whatever it is: `for_decoding`)."""
    return cls(config, init_params(config, seed), tokenizer)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def logical_axes(self) -> Any:
    """Logical PartitionSpecs of the float parameters of this model's layout."""
    return logical_axes(self.config)

  def with_config(self, **changes: Any) -> "TargetModel":
    """Same weights under a changed architecture config (e.g. layer_windows=...); run options
    change through `with_options`."""
    return dataclasses.replace(self, config=self.config.replace(**changes))

  def with_options(self, options: RunOptions | None = None, **changes: Any) -> "TargetModel":
    """Same weights, run differently: `options` (whole) and/or `changes` (RunOptions fields,
    e.g. moe_backend='dense', attention_impl='xla'). A change of `scan_layers` re-lays the
    weights out (`with_scan_layers`); a change of `param_dtype` does not cast them.
    """
    new = (options or self.config.options).replace(**changes)
    scan = new.scan_layers
    config = self.config.replace(options=new.replace(scan_layers=self.config.options.scan_layers))
    return dataclasses.replace(self, config=config).with_scan_layers(scan)

  def for_decoding(self) -> "TargetModel":
    """This model in decoding's layout: itself when its layers are already one buffer each,
    else re-laid out from the scanned (training) layout, with a one-line warning.

    Decoding never runs on the scanned layout: each step would copy every layer's weights
    out of the stack (31% of the matvec bandwidth against ~70% unrolled, on a 1.5 GB dense
    model). `load_model(dir)` already loads per layer (slicing the host arrays as they are
    read); `TargetModel.random(config)` keeps the layout `config.options` says (stacked by
    default: a config is training's unless asked otherwise), so engines call this on the
    target they are given. The conversion holds both layouts until the scanned model is
    dropped.
    """
    if not self.config.options.scan_layers:
      return self
    warnings.warn(
      "decoding re-lays the scanned (training) layer layout out per layer; load with "
      "scan_layers=False (or call with_scan_layers(False)) to skip the copy",
      UserWarning,
      stacklevel=2,
    )
    return self.with_scan_layers(False)

  def with_scan_layers(self, scan: bool) -> "TargetModel":
    """The same model with its layer weights stacked for `nn.scan` (True) or one buffer per
    layer (False, decoding's layout: no per-step weight copies; see RunOptions.scan_layers).

    Converts once, holding both layouts until the old model is dropped; to decode a large
    checkpoint unscanned, load it so (`load_model(dir, scan_layers=False)`), which slices the
    host arrays as they are read.
    """
    if scan == self.config.options.scan_layers:
      return self
    convert = stack_layer_params if scan else unstack_layer_params
    params = convert(self.config, self.params)
    config = self.config.with_options(scan_layers=scan)
    return dataclasses.replace(self, config=config, params=params)

  def init_state(self, batch: int, max_len: int, kv_format: str = "float") -> DecodingState:
    """A zero decoding state for `batch` sequences of up to `max_len` tokens."""
    return DecodingState.create(self.config, batch, max_len, kv_format)

  def check_tokens(self, tokens: Any) -> np.ndarray:
    """Validates token ids: integer, 2-D, inside the vocabulary."""
    arr = np.asarray(tokens)
    if arr.ndim == 1:
      arr = arr[None]
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
      raise InputError(
        f"token ids must be a [batch, length] integer array, got {arr.dtype} {arr.shape}"
      )
    if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
      bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
      raise InputError(
        f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:8].tolist()}"
      )
    return arr.astype(np.int32)

  def logits(self, token_ids: Any) -> jax.Array:
    """A full causal forward: [B, T] int → [B, T, V] float32 logits (for parity checks)."""
    tokens = jnp.asarray(self.check_tokens(token_ids))
    return forward(self.config, self.params, tokens).logits
