"""Continuous batching under load: throughput and per-request speed against concurrency.

For each method (plain, EAGLE-3 chain, DFlash + DDTree on the bundled pair) and each
concurrency c, an engine with c slots serves `--waves` × c requests submitted by c client
threads, each sending its next request as soon as the last one finished (a closed loop, as a
server sees steady load). Reported per (method, c), from one run:

* throughput: generated tokens / wall time of the whole load (compilation excluded: the
  scheduler warms up before the clock starts);
* per-request tokens/s: each request's tokens / its time from submission to its last token,
  averaged;
* acceptance length, target passes and the mean step time (from the scheduler's counters);
* the speedup of each method over plain at the same concurrency.

  python launch/bench.py serve                       # 3 methods × c = 1, 4, 16 (~15 min on 2 cores)
  python launch/bench.py serve --concurrency=1,4 --methods=plain,eagle3

Writes JSON and a PNG beside it (`--out`). A script, not a test: numbers on this CPU are
compute-bound (a step over c rows costs about c times one row), so speculative gains shrink
as c grows here; on an accelerator a step's cost stays near flat in c and T.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Sequence

from absl import flags
import numpy as np

import jaxspec
from jaxspec.drafters import registry
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.train import data as data_lib
from launch.cli import common_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("methods", ["plain", "eagle3", "dflash-ddtree"], "plain, eagle3, dflash-ddtree.")
  flags.DEFINE_list("concurrency", ["1", "4", "16"], "Client threads (= engine slots).")
  flags.DEFINE_integer("waves", 2, "Requests per client thread.")
  flags.DEFINE_integer("max_tokens", 64, "Tokens per request (greedy; EOS stops early).")
  flags.DEFINE_integer("tree_budget", 22, "DDTree draft nodes per step.")
  flags.DEFINE_integer("steps_per_tick", 4, "Engine steps per scheduler round trip.")
  common_flags.define_max_len(256)
  common_flags.define_out("/tmp/jaxspec_bench_serve.json", "results JSON (PNG beside it)")


def build_engine(
  target: jaxspec.TargetModel, method: str, slots: int, **config: Any
) -> jaxspec.SpecEngine:
  """The engine of a method label with `slots` rows (`config`: more EngineConfig fields)."""
  cfg = dict(max_len=FLAGS.max_len, batch_size=slots, stream_every=FLAGS.steps_per_tick)
  cfg.update(config)
  if method == "plain":
    return jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(**cfg))
  name = method.split("-")[0]
  drafter = registry.make_drafter(name, target, draft_dir=registry.bundled_dir(name))
  if method.endswith("ddtree"):
    cfg.update(verify="tree", tree_budget=FLAGS.tree_budget)
  return jaxspec.SpecEngine(target, drafter, jaxspec.EngineConfig(**cfg))


def run_load(scheduler: Scheduler, prompts: Sequence[list[int]], clients: int) -> dict[str, Any]:
  """`clients` threads, each sending `--waves` requests back to back."""
  per_request: list[tuple[int, float]] = []
  lock = threading.Lock()
  options = SamplingOptions(max_tokens=FLAGS.max_tokens, temperature=0.0, seed=0)

  def client(c: int) -> None:
    for w in range(FLAGS.waves):
      ids = prompts[(c * FLAGS.waves + w) % len(prompts)]
      t0 = time.perf_counter()
      tokens, _, _ = scheduler.submit(ids, options).result()
      with lock:
        per_request.append((len(tokens), time.perf_counter() - t0))

  before = scheduler.metrics()
  t0 = time.perf_counter()
  threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  after = scheduler.metrics()
  tokens = sum(n for n, _ in per_request)
  passes = after["target_passes_total"] - before["target_passes_total"]
  return {
    "requests": len(per_request),
    "tokens": tokens,
    "wall_s": wall,
    "throughput_tok_s": tokens / wall,
    "per_request_tok_s": float(np.mean([n / s for n, s in per_request])),
    "latency_p50_s": float(np.percentile([s for _, s in per_request], 50)),
    "target_passes": passes,
    "acceptance_length": after["acceptance_length"],
    "step_seconds_avg": after["step_seconds_avg"],
  }


def plot(results: dict[str, dict[int, dict]], path: str) -> str | None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for method, by_c in results.items():
    cs = sorted(by_c)
    axes[0].plot(cs, [by_c[c]["throughput_tok_s"] for c in cs], marker="o", label=method)
    axes[1].plot(cs, [by_c[c]["per_request_tok_s"] for c in cs], marker="o", label=method)
  for ax, title in zip(axes, ("throughput (tokens/s)", "per-request tokens/s")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (= slots)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def table(results: dict[str, dict[int, dict]]) -> list[str]:
  lines = [
    f"{'method':<16}{'c':>4}{'tok/s':>9}{'req tok/s':>11}{'vs plain':>10}{'τ':>7}"
    f"{'step ms':>9}{'p50 s':>8}"
  ]
  plain = results.get("plain", {})
  for method, by_c in results.items():
    for c in sorted(by_c):
      r = by_c[c]
      ratio = r["throughput_tok_s"] / plain[c]["throughput_tok_s"] if c in plain else float("nan")
      lines.append(
        f"{method:<16}{c:>4}{r['throughput_tok_s']:>9.1f}{r['per_request_tok_s']:>11.1f}"
        f"{ratio:>9.2f}×{r['acceptance_length']:>7.2f}{1e3 * r['step_seconds_avg']:>9.1f}"
        f"{r['latency_p50_s']:>8.2f}"
      )
  return lines


def main(argv: Sequence[str]) -> None:
  del argv
  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  texts = data_lib.function_prompts("validation", n=32, seed=0)
  prompts = [target.tokenizer.encode(t)[:96] for t in texts]
  results: dict[str, dict[int, dict]] = {}
  for method in FLAGS.methods:
    for c in (int(x) for x in FLAGS.concurrency):
      scheduler = Scheduler(build_engine(target, method, c), max_queue=4 * c)
      scheduler.start()  # compiles (warm_up_slots) before the clock
      try:
        r = run_load(scheduler, prompts, c)
      finally:
        scheduler.shutdown(drain=False, timeout=600)
      results.setdefault(method, {})[c] = r
      print(f"{method} c={c}: {json.dumps(r)}", flush=True)
  print("\n".join(table(results)))
  with open(FLAGS.out, "w") as f:
    json.dump({m: {str(c): r for c, r in by.items()} for m, by in results.items()}, f, indent=1)
  png = plot(results, os.path.splitext(FLAGS.out)[0] + ".png")
  print(f"saved {FLAGS.out}" + (f" and {png}" if png else ""))
