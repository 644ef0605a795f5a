"""Decode step cost against context length: hybrid (Gated DeltaNet) targets against attention.

For each model and context, one prompt of that many tokens is prefilled, then `--new_tokens`
tokens are decoded plainly (one token per target pass); the decode step cost is
decode seconds / (tokens − 1), after a warm-up call of the same shapes. Models:

* `hybrid`: the bundled hybrid target (jaxspec/assets/hybrid: 3 linear : 1 full attention);
* `attention`: the bundled GLM target (4 full-attention layers, the same width and experts);
* `linear`: the hybrid's architecture with every layer a Gated DeltaNet layer (random weights;
  cost does not depend on the weights' values): the linear layers alone;
* `mimo`: a MiMo-V2-Flash-shaped random model (12 layers, full attention at layers 0, 5, 11 and
  sliding windows of 128 elsewhere, sliding layers with twice the KV heads and sinks, qk head
  192-style 96 wide with values of 64, a dense first layer then 8-expert MoE layers), whose
  sliding layers keep rings of window + 1 slots (jaxspec/state/sliding.py);
* `mimo-swa`: the same with every layer sliding: the sliding layers alone;
* `mimo-full`: the same with every layer full attention.

A layer of linear attention reads a fixed-size state per step, and a sliding layer a ring of
its window, so their cost must not grow with the context; full attention reads the whole KV
cache. Also printed: the decoding state's bytes
per sequence (jaxspec.plan.decoding_state_bytes). Prompts are random token ids (timing only).

  python launch/bench.py hybrid-context --contexts=1024,32768
"""

from __future__ import annotations

import functools
import json
import time

from absl import flags
import numpy as np

import jaxspec
from jaxspec import plan
from jaxspec.drafters import registry
from jaxspec.io.architectures import config_from_hf
from launch.cli import common_flags


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("contexts", ["1024", "32768"], "Prompt lengths (tokens).")
  flags.DEFINE_list("models", ["hybrid", "attention", "linear"], "Models (see the docstring).")
  flags.DEFINE_integer("new_tokens", 64, "Tokens decoded after each prompt.")
  flags.DEFINE_integer("repeats", 3, "Timed calls per (model, context); the fastest counts.")
  common_flags.define_out("", "also write the rows here (JSON)")


FLAGS = flags.FLAGS


def mimo_shaped(kinds: str = "hybrid") -> dict:
  """A small MiMo-V2-Flash-shaped config.json (transformers' own keys): "hybrid" (its 5 : 1
  pattern), "swa" (every layer sliding) or "full" (none)."""
  layers = 12
  pattern = {
    "hybrid": ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
               for i in range(layers)],
    "swa": ["sliding_attention"] * layers,
    "full": ["full_attention"] * layers,
  }[kinds]
  rope = lambda theta: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1 / 3}
  return {
    "architectures": ["MiMoV2FlashForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": layers,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 96,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 129,  # 128 earlier keys and the query's own
    "layer_types": pattern,
    "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
    "rope_parameters": {"full_attention": rope(5e6), "sliding_attention": rope(1e4)},
    "max_position_embeddings": 65536,
  }


@functools.lru_cache(maxsize=None)
def _model(name: str) -> jaxspec.TargetModel:
  """The model `name`, loaded once for all its contexts."""
  if name.startswith("mimo"):
    kinds = {"mimo": "hybrid", "mimo-swa": "swa", "mimo-full": "full"}[name]
    config = config_from_hf(mimo_shaped(kinds))
    return jaxspec.TargetModel.random(config.with_options(scan_layers=False), seed=0)
  if name == "attention":
    return jaxspec.load_model(registry.bundled_dir("target"))
  hybrid = jaxspec.load_model(registry.bundled_dir("hybrid"))
  if name == "hybrid":
    return hybrid
  cfg = hybrid.config
  linear = cfg.replace(layer_types=("linear_attention",) * cfg.num_layers, num_mtp_layers=0)
  return jaxspec.TargetModel.random(linear, seed=0)


def measure(name: str, context: int) -> dict:
  """Decode step cost and state bytes of model `name` after a `context`-token prompt."""
  model = _model(name)
  max_len = context + FLAGS.new_tokens + 2
  engine = jaxspec.SpecEngine(
    model, None, jaxspec.EngineConfig(max_len=max_len, batch_size=1, use_eos=False)
  )
  prompt = np.random.default_rng(context).integers(3, model.config.vocab_size, context).tolist()
  engine.generate([prompt], max_new_tokens=FLAGS.new_tokens)  # compiles every shape used
  best = None
  for _ in range(FLAGS.repeats):
    stats = engine.generate([prompt], max_new_tokens=FLAGS.new_tokens).stats
    step = stats.decode_time_s / max(stats.tokens_generated - 1, 1)
    best = step if best is None else min(best, step)
  return {
    "model": name,
    "context": context,
    "step_ms": 1e3 * best,
    "state_bytes": plan.decoding_state_bytes(model.config, 1, max_len, slack=engine.slack),
  }


def main(argv) -> None:
  del argv
  rows = []
  t0 = time.time()
  for name in FLAGS.models:
    for context in map(int, FLAGS.contexts):
      rows.append(measure(name, context))
      print(json.dumps(rows[-1]), flush=True)
  print(f"\n{'model':>10} {'context':>8} {'step ms':>9} {'× first':>8} {'state MiB':>10}")
  for name in FLAGS.models:
    mine = [r for r in rows if r["model"] == name]
    for r in mine:
      print(
        f"{name:>10} {r['context']:>8} {r['step_ms']:>9.2f} "
        f"{r['step_ms'] / mine[0]['step_ms']:>8.2f} {r['state_bytes'] / 2**20:>10.2f}"
      )
  print(f"({time.time() - t0:.0f} s)")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(rows, f, indent=2)
