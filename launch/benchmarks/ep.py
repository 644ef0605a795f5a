"""Step time of the expert-parallel MoE backend against the GSPMD path, on one mesh.

Both run the same sharded weights (experts over `expert`, `mlp` over `tensor`): GSPMD traces the
target without a mesh context, so XLA partitions the local MoE backend itself; the EP backends
trace under `sharding.use_mesh` and run jaxspec.models.expert_parallel's shard_map. Times one
forward of T tokens per sequence (decode T = 1, a verify block, a prefill chunk) on random weights
of a Qwen3-MoE-like shape, and prints each time and the ratio to GSPMD's. On CPU it sets up
virtual devices itself:

  python launch/bench.py ep --mesh=data=1,expert=8,tensor=1
  python launch/bench.py ep --mesh=data=2,expert=2,tensor=2 --tokens=1,16,128

Ratios on virtual CPU devices measure the partitioning's overheads (all devices share the host's
cores and memory), not an accelerator's interconnect; the planner's traffic model
(launch/plan.py) gives the bytes. `--json` is an alias of `--out`.
"""

from __future__ import annotations

import functools
import json
import os

from absl import flags

from launch.cli import common_flags

DEFAULT_MESH = "data=1,expert=8,tensor=1"


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_string("mesh", DEFAULT_MESH, "Mesh: data, expert and tensor sizes.")
  flags.DEFINE_list("tokens", ["1", "16", "128"], "Tokens per sequence of each timed forward.")
  flags.DEFINE_integer("batch", 2, "Sequences per forward.")
  flags.DEFINE_integer("experts", 32, "Routed experts per MoE layer.")
  flags.DEFINE_integer("top_k", 4, "Experts per token.")
  flags.DEFINE_integer("hidden", 256, "Hidden size.")
  flags.DEFINE_integer("moe_intermediate", 256, "Expert width.")
  flags.DEFINE_integer("layers", 4, "Decoder layers (all MoE).")
  flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (the median is reported).")
  common_flags.define_out("", "also write the results here (JSON)")
  flags.DEFINE_alias("json", "out")


FLAGS = flags.FLAGS


def _devices_needed(argv: list[str]) -> int:
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--mesh=")), DEFAULT_MESH)
  n = 1
  for part in spec.split(","):
    n *= int(part.partition("=")[2] or 1)
  return n


def prepare_environment(argv: list[str]) -> None:
  """On CPU, as many virtual devices as --mesh needs (before the backend starts)."""
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    os.environ.setdefault(
      "XLA_FLAGS", f"--xla_force_host_platform_device_count={_devices_needed(argv)}"
    )


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxspec import sharding  # pylint: disable=import-outside-toplevel
  from jaxspec.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.plan.scale import mesh_sizes  # pylint: disable=import-outside-toplevel
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  cfg = ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    vocab_size=1024,
    hidden_size=FLAGS.hidden,
    num_layers=FLAGS.layers,
    num_heads=8,
    num_kv_heads=4,
    head_dim=FLAGS.hidden // 8,
    intermediate_size=4 * FLAGS.hidden,
    num_experts=FLAGS.experts,
    num_experts_per_tok=FLAGS.top_k,
    moe_intermediate_size=FLAGS.moe_intermediate,
    norm_topk_prob=True,
  )
  mesh = sharding.make_mesh(mesh_sizes(FLAGS.mesh))
  model = target_lib.TargetModel.random(cfg, seed=0)
  params = sharding.shard_tree(model.params, target_lib.logical_axes(cfg), mesh)
  rng = np.random.default_rng(0)
  rows = []
  for t in (int(x) for x in FLAGS.tokens):
    tokens = rng.integers(0, cfg.vocab_size, (FLAGS.batch, t)).astype(np.int32)
    tokens = sharding.shard_tree(tokens, ("batch", None), mesh)
    times = {}
    for backend in ("gspmd", "ep", "ep_replicate", "ep_all_to_all"):
      run_cfg = cfg.with_options(moe_backend="auto" if backend == "gspmd" else backend)
      fwd = jax.jit(functools.partial(target_lib.forward, run_cfg))
      call = lambda: fwd(params, tokens).logits.block_until_ready()  # noqa: B023
      if backend == "gspmd":
        times[backend] = roofline.median_seconds(call, FLAGS.repeats)
      else:
        with sharding.use_mesh(mesh):
          times[backend] = roofline.median_seconds(call, FLAGS.repeats)
    base = times["gspmd"]
    rows.append({"tokens": t, **{k: v * 1e3 for k, v in times.items()}})
    print(
      f"T={t:4d}  gspmd {base * 1e3:8.2f} ms  "
      + "  ".join(
        f"{k} {v * 1e3:8.2f} ms ({v / base:.2f}×)" for k, v in times.items() if k != "gspmd"
      )
    )
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"mesh": FLAGS.mesh, "config": str(cfg), "rows": rows}, f, indent=1)
