"""Planning a run's memory and interconnect traffic before anything is allocated.

Two jobs:

* what one `SpecEngine` holds for the live models it is given (weights, the target's decoding
  state, the drafter's state, token buffers) and whether that fits the free memory: that lives
  beside the engine, which checks it at construction (`jaxspec.speculative.memory`), and is
  re-exported here;
* `arch` + `scale`: what a model described only by its HF config.json would need on a device
  mesh (per-device parameter bytes by format, KV/recurrent state, drafter, verify-block
  activations), whether that fits a named accelerator, and the bytes each decode step and each
  verify block moves over the interconnect (`launch/plan.py`, docs/planning.md).
"""

from jaxspec.speculative.memory import (
  MemoryPlan,
  check_fits,
  decoding_state_bytes,
  drafter_state_bytes,
  engine_plan,
  free_bytes,
  human_bytes,
  kv_bytes_per_token,
  kv_table,
  tree_bytes,
)

__all__ = [
  "MemoryPlan",
  "check_fits",
  "decoding_state_bytes",
  "drafter_state_bytes",
  "engine_plan",
  "free_bytes",
  "human_bytes",
  "kv_bytes_per_token",
  "kv_table",
  "tree_bytes",
]
