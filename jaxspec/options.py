"""`RunOptions`: how jaxspec runs a model, as opposed to what the model is.

A checkpoint's config.json fixes the architecture (`ModelConfig`); everything here is a choice
made at run time: kernels and backends, chunk sizes, the parameter layout and the dtypes. The HF
mapping (jaxspec.io.architectures) never reads or writes them. `ModelConfig` carries one
`RunOptions` as its `options` field, so that one hashable object stays the static argument of
each compiled program (a change of options is a recompile, as it must be).

Set them with `load_model(dir, options=RunOptions(...))`, `TargetModel.with_options(...)` or
`config.replace(options=...)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxspec.errors import ConfigError, is_int, is_real, show

MOE_BACKENDS = ("auto", "dense", "ragged", "gather", "loop", "ep", "ep_replicate", "ep_all_to_all")
IMPLS = ("auto", "xla", "pallas")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """Implementation choices for running a target model; none of them changes what it computes
  beyond floating-point rounding (`dtype`, `param_dtype`) or, with a capacity, dropped expert
  pairs (`ep_capacity_factor`)."""

  # "dense" (the oracle), "ragged", "gather", "loop", "auto", or expert-parallel on a mesh "ep",
  # "ep_replicate", "ep_all_to_all" (see models/moe.py and models/expert_parallel.py).
  moe_backend: str = "auto"
  # Expert-parallel all_to_all buffers: 0 = exact (no pair ever dropped), f > 0 = rows for f times
  # the mean load per destination, later pairs dropped (models/expert_parallel.py).
  ep_capacity_factor: float = 0.0
  # Grouped matmul of the ragged backend over MXFP4 expert weights: "xla" (dequantize, then
  # ragged_dot), "pallas" (pallas_kernels/mxfp4_gmm, dequantized tile by tile) or "auto" (XLA
  # until the kernel has run on hardware).
  gmm_impl: str = "auto"
  # Attention over the decoding state (models/attention.py): "xla" (chunked online softmax),
  # "pallas" (the tree-attention kernel) or "auto" (XLA until the kernel is checked on hardware);
  # the XLA path reads the committed prefix in chunks of `attention_chunk` slots.
  attention_impl: str = "auto"
  attention_chunk: int = 256
  # Chunk of the chunked delta rule (prefill, long blocks) of hybrid targets' linear layers.
  linear_chunk: int = 64
  # The chunked rule of the linear layers' prefill / long blocks: "xla" (`lax.scan` over chunks),
  # "pallas" (pallas_kernels/gated_delta) or "auto" (XLA until the kernel has run on hardware).
  linear_attention_impl: str = "auto"
  # How many per-position states a linear layer's decoding state keeps for a block (the widest
  # block chain verification may commit a prefix of; models/gated_deltanet.py, LinearState).
  linear_snapshots: int = 16
  # Layer runs as one `nn.scan` over stacked parameters [n, ...] (True: compile time flat in
  # depth; training's layout), or unrolled over per-layer parameter buffers (False: decoding's
  # layout, since a scanned layer's weights are sliced out of the stack, a copy on backends
  # that cannot feed a matmul from a slice; see docs/benchmarks.md). Convert with
  # `TargetModel.with_scan_layers`; engines decode per layer whatever this says
  # (`TargetModel.for_decoding`).
  scan_layers: bool = True
  # Numerics: dtype of activations/matmuls; parameters are stored in `param_dtype`.
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    self.validate()

  def replace(self, **changes: Any) -> "RunOptions":
    """A copy with `changes` applied, validated; unknown names are a ConfigError."""
    unknown = sorted(set(changes) - set(option_names()))
    if unknown:
      raise ConfigError(f"unknown RunOptions field(s) {', '.join(unknown)}")
    return dataclasses.replace(self, **changes)

  def validate(self) -> None:
    """Raises ConfigError naming the first option jaxspec cannot run as given."""

    def need(cond: bool, msg: str) -> None:
      if not cond:
        raise ConfigError(msg)

    for name in ("attention_chunk", "linear_chunk", "linear_snapshots"):
      v = getattr(self, name)
      need(is_int(v), f"{name} must be an integer, got {show(v)}")
      need(v > 0, f"{name} must be positive, got {v}")
    need(
      isinstance(self.scan_layers, bool),
      f"scan_layers must be True or False, got {show(self.scan_layers)}",
    )
    need(
      self.moe_backend in MOE_BACKENDS,
      f"unknown moe_backend {self.moe_backend!r}; expected one of {MOE_BACKENDS}",
    )
    factor = self.ep_capacity_factor
    need(
      is_real(factor) and math.isfinite(factor) and factor >= 0,
      f"ep_capacity_factor must be a finite number >= 0 (0: exact), got {factor!r}",
    )
    for name in ("gmm_impl", "attention_impl", "linear_attention_impl"):
      v = getattr(self, name)
      need(v in IMPLS, f"unknown {name} {v!r} (expected 'auto', 'xla' or 'pallas')")
    for name in ("dtype", "param_dtype"):
      v = getattr(self, name)
      need(
        v in DTYPES,
        f"unsupported {name} {show(v)} (expected 'float32', 'bfloat16' or 'float16')",
      )


def option_names() -> tuple[str, ...]:
  """The names of RunOptions' fields."""
  return tuple(f.name for f in dataclasses.fields(RunOptions))
