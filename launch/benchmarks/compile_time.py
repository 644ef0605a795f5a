"""Compile time and per-token decode time versus depth: nn.scan keeps compile time flat.

python launch/bench.py compile --layers=2,16
"""

from __future__ import annotations

import time

from absl import flags
import jax

import jaxspec

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("layers", ["2", "16"], "Depths to compare.")
  flags.DEFINE_integer("new_tokens", 64, "Decode steps timed.")
  flags.DEFINE_string("architecture", "Glm4MoeForCausalLM", "Architecture.")


def measure(num_layers: int) -> dict:
  moe = FLAGS.architecture != "Qwen3ForCausalLM"
  cfg = jaxspec.ModelConfig(
    architecture=FLAGS.architecture,
    vocab_size=8192,
    hidden_size=128,
    num_layers=num_layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=384,
    num_experts=8 if moe else 0,
    num_experts_per_tok=2 if moe else 0,
    moe_intermediate_size=96 if moe else 0,
    router="sigmoid" if FLAGS.architecture == "Glm4MoeForCausalLM" else "softmax",
    n_shared_experts=1 if FLAGS.architecture == "Glm4MoeForCausalLM" else 0,
    layer_is_moe=((False,) + (True,) * (num_layers - 1)) if moe else (),
    partial_rotary_factor=0.5 if FLAGS.architecture == "Glm4MoeForCausalLM" else 1.0,
  )
  model = jaxspec.TargetModel.random(cfg)
  engine = jaxspec.SpecEngine(model, None, jaxspec.EngineConfig(max_len=256, use_eos=False))
  prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
  t0 = time.perf_counter()
  state = engine.init_state(prompt, max_new_tokens=FLAGS.new_tokens)
  lowered = engine._loop.lower(model.params, None, state)  # pylint: disable=protected-access
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  engine.generate(prompt, max_new_tokens=FLAGS.new_tokens)  # warm (compiles via the jit cache)
  out = engine.generate(prompt, max_new_tokens=FLAGS.new_tokens)
  return dict(
    layers=num_layers,
    trace_s=t1 - t0,
    compile_s=t2 - t1,
    ms_per_token=1e3 * out.stats.decode_time_s / max(out.stats.tokens_generated - 1, 1),
  )


def main(argv):
  del argv
  print(f"{'layers':>6} {'trace+prefill s':>16} {'compile s':>10} {'ms/token':>9}")
  for n in FLAGS.layers:
    r = measure(int(n))
    print(
      f"{r['layers']:>6} {r['trace_s']:>16.2f} {r['compile_s']:>10.2f} {r['ms_per_token']:>9.2f}"
    )
  print(f"backend: {jax.default_backend()}, devices: {jax.device_count()}")
