"""What the KV cache costs: plain decoding time against max_len, and FP8-KV fidelity.

Two measurements on the bundled target (or --model), printed as ratios from one run:

1. Length-proportional attention. Plain decoding of one `--prompt_tokens` prompt plus
   `--new_tokens` tokens in engines built with each `--max_lens` value (same prompt, same work);
   the table gives seconds per generated token and the ratio to the smallest max_len. Attention
   reads the committed prefix chunk by chunk, so the ratio should stay near 1 however large
   max_len is (before the chunked path it was 24× at 32K).
2. FP8 KV fidelity. Greedy decoding of `--num_prompts` validation prompts with a float and an
   FP8 (E4M3, per token and head) cache; reports the fraction of generated tokens that match up
   to the first divergence, and overall.

  python launch/bench.py kv
  python launch/bench.py kv --max_lens=1024,8192,32768 --kv_formats=float,fp8,q4_0
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from absl import flags
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import plan
from jaxspec.profiling import roofline
from jaxspec.models import target as target_lib
from jaxspec.train import data as data_lib
from launch.cli import common_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_string("model", None, "Target HF directory (default: the bundled target).")
  flags.DEFINE_list("max_lens", ["1024", "8192", "32768"], "Engine max_len values to compare.")
  common_flags.define_kv_formats()
  flags.DEFINE_integer("prompt_tokens", 450, "Prompt length for the timing runs.")
  flags.DEFINE_integer("new_tokens", 64, "Tokens generated per timing run.")
  flags.DEFINE_integer("repeats", 3, "Timed runs per engine (the minimum is reported).")
  flags.DEFINE_integer("num_prompts", 8, "Validation prompts for the FP8 fidelity check.")
  flags.DEFINE_integer("fidelity_tokens", 64, "Greedy tokens per prompt in the fidelity check.")


def _long_prompt(tokenizer, n: int) -> list[int]:
  """The first n tokens of the validation split (real code, not repeated filler)."""
  text = "\n\n".join(data_lib.function_prompts("validation", n=64, seed=0))
  ids = tokenizer.encode(text)
  while len(ids) < n:
    ids = ids + ids
  return ids[:n]


def time_plain(
  target: jaxspec.TargetModel, prompt: list[int], new: int, max_len: int, kv: str, repeats: int
) -> float:
  """Seconds per generated token of plain decoding (compile excluded; minimum over repeats)."""
  cfg = jaxspec.EngineConfig(max_len=max_len, use_eos=False, kv_format=kv, min_prompt_bucket=512)
  engine = jaxspec.SpecEngine(target, None, cfg)
  engine.generate([prompt], max_new_tokens=new)  # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = engine.generate([prompt], max_new_tokens=new)
    best = min(best, (time.perf_counter() - t0) / len(out.tokens[0]))
  return best


def fidelity(
  target: jaxspec.TargetModel, num_prompts: int, new: int, kv_format: str = "fp8"
) -> dict[str, float]:
  """Greedy output on a `kv_format` cache against a float32 cache, on validation prompts."""
  prompts = [
    target.tokenizer.encode(p)
    for p in data_lib.function_prompts("validation", n=num_prompts, seed=0)
  ]
  max_len = max(len(p) for p in prompts) + new + 8
  outs = {}
  for kv in ("float", kv_format):
    cfg = jaxspec.EngineConfig(
      max_len=max_len, batch_size=len(prompts), use_eos=False, kv_format=kv
    )
    outs[kv] = jaxspec.SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=new).tokens
  same = prefix = total = 0
  for a, b in zip(outs["float"], outs[kv_format]):
    eq = np.asarray(a) == np.asarray(b)
    same += int(eq.sum())
    prefix += int(np.argmin(eq)) if not eq.all() else len(eq)
    total += len(eq)
  # Teacher-forced along the float continuation: one forward per format over prompt + output
  # (a block attends to its own K/V as the cache stores them, so this is exactly what a
  # quantized cache gives at every position), top-1 agreement at the generated positions.
  agree = count = 0
  for p, gen in zip(prompts, outs["float"]):
    seq = jnp.asarray([p + gen[:-1]], jnp.int32)
    top = {}
    for kv in ("float", kv_format):
      state = target.init_state(1, seq.shape[1], kv)
      logits = target_lib.forward(target.config, target.params, seq, None, state).logits
      top[kv] = np.asarray(jnp.argmax(logits[0, len(p) - 1 :], axis=-1))
    agree += int(np.sum(top["float"] == top[kv_format]))
    count += len(gen)
  return {
    "match_overall": same / total,
    "match_before_divergence": prefix / total,
    "teacher_forced_top1": agree / count,
  }


def main(argv: Sequence[str]) -> None:
  del argv
  model = FLAGS.model or os.path.join(os.path.dirname(jaxspec.__file__), "assets", "target")
  target = jaxspec.load_model(model, scan_layers=False)
  prompt = _long_prompt(target.tokenizer, FLAGS.prompt_tokens)
  lens = [int(x) for x in FLAGS.max_lens]
  print(f"plain decoding, {len(prompt)}-token prompt + {FLAGS.new_tokens} tokens, {model}")
  print(f"{'kv':>6} {'max_len':>8} {'ms/token':>9} {'× smallest':>11}")
  for kv in FLAGS.kv_formats:
    base = None
    for n in lens:
      s = time_plain(target, prompt, FLAGS.new_tokens, n, kv, FLAGS.repeats)
      base = base or s
      print(f"{kv:>6} {n:>8} {s * 1e3:>9.2f} {s / base:>11.2f}")
  print(f"\nKV memory, batch 1 ({model}):")
  print("\n".join(plan.kv_table(target.config)))
  qwen3_8b = roofline.dense_config(
    hidden=4096, layers=36, intermediate=12288, vocab=151936, kv_heads=8, dtype="bfloat16"
  )
  print("KV memory, batch 1, a Qwen3-8B-shaped config (36 layers, 8 KV heads × 128, bf16):")
  print("\n".join(plan.kv_table(qwen3_8b)))
  # Qwen3.5-27B: 64 layers, every 4th full attention (24 heads, 4 KV heads × 256); the other
  # 48 are Gated DeltaNet layers whose recurrent state does not grow with the context.
  qwen35_27b = roofline.dense_config(
    hidden=5120,
    layers=16,
    intermediate=17408,
    vocab=248320,
    head_dim=256,
    kv_heads=4,
    dtype="bfloat16",
  )
  print(
    "KV memory, batch 1, a Qwen3.5-27B-shaped config (its 16 full-attention layers of 64, "
    "4 KV heads × 256, bf16; the Gated DeltaNet state is constant in the context):"
  )
  print("\n".join(plan.kv_table(qwen35_27b)))
  for kv in (k for k in FLAGS.kv_formats if k != "float"):
    f = fidelity(target, FLAGS.num_prompts, FLAGS.fidelity_tokens, kv)
    print(
      f"\n{kv} KV vs float32 KV, greedy, {FLAGS.num_prompts} validation prompts × "
      f"{FLAGS.fidelity_tokens} tokens: {f['match_overall']:.1%} of tokens equal, "
      f"{f['match_before_divergence']:.1%} before each sequence's first divergence; "
      f"teacher-forced top-1 agreement {f['teacher_forced_top1']:.1%}"
    )
