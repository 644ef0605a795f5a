"""Long context on one host: the bundled target + DFlash + DDTree from 1K to 128K tokens.

Prompts are long real text: the train split's corpus files concatenated and tokenized (the
bundled target was trained on 256-token windows, so this measures mechanics, memory and
speed, not quality). Four measurements, each run in its own subprocess so that its peak
memory is its own:

1. sweep: for each context × KV format, one prompt of that many tokens, prefilled chunk by
   chunk, then `--new_tokens` tokens of DFlash + DDTree: peak RSS, KV bytes, drafter state
   bytes, prefill seconds, decode tokens/s, acceptance length (compile excluded: a warm-up
   call with the same chunk shape first).
2. acceptance: DFlash + DDTree acceptance length at `--acceptance_context` tokens with each KV
   format against float32 KV (several prompts).
3. fidelity: at each `--fidelity_contexts`, the target teacher-forced over the next
   `--fidelity_tokens` tokens after a prefilled context, on each quantized cache against the
   float32 cache: mean KL(float ‖ quantized) and top-1 agreement.
4. ring: DFlash + DDTree acceptance length at `--ring_context` with the drafter's feature ring
   of `--ring_window` against an unbounded one, and the drafter state each holds.

Results accumulate in `--out` (JSON, keyed by measurement), so a long sweep can be split over
runs; the table and the plot (decode tokens/s against context, `--out` with .png) are made from
everything the file holds.

  python launch/bench.py long                                  # everything, about 2 h on 2 cores
  python launch/bench.py long --only=sweep --contexts=1024,8192 --kv_formats=float,q4_0
  python launch/bench.py long --only=report                    # table + plot from the JSON
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from typing import Any, Sequence

from absl import flags
import numpy as np

from launch import benchmarks
from launch.cli import common_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("contexts", ["1024", "8192", "32768", "131072"], "Prompt lengths (tokens).")
  common_flags.define_kv_formats()
  flags.DEFINE_integer("new_tokens", 64, "Tokens generated after each sweep prompt.")
  flags.DEFINE_integer("tree_budget", 8, "DDTree draft nodes per step.")
  flags.DEFINE_integer("acceptance_context", 2048, "Context of the acceptance comparison.")
  flags.DEFINE_integer("acceptance_prompts", 4, "Prompts of the acceptance and ring comparisons.")
  flags.DEFINE_integer("acceptance_tokens", 96, "Tokens generated per acceptance prompt.")
  flags.DEFINE_list("fidelity_contexts", ["8192", "32768"], "Contexts of the KL / top-1 check.")
  flags.DEFINE_integer("fidelity_tokens", 256, "Teacher-forced tokens after each context.")
  flags.DEFINE_integer("ring_context", 8192, "Context of the ring comparison.")
  flags.DEFINE_integer("ring_window", 4096, "Feature ring size under test (against unbounded).")
  flags.DEFINE_list(
    "only", ["sweep", "acceptance", "fidelity", "ring", "report"], "Measurements to run."
  )
  common_flags.define_out("/tmp/jaxspec_bench_long.json", "results JSON (plot beside it)")
  flags.DEFINE_string("job", None, "Internal: run one measurement (JSON) and print its result.")


RESULT_TAG = "BENCH_LONG_RESULT "


# ------------------------------------------------------------------------------------------------
# Inside a job subprocess
# ------------------------------------------------------------------------------------------------


def _models(window: int | None = None):
  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters import registry  # pylint: disable=import-outside-toplevel

  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  kw = {} if window is None else {"context_window": window}
  drafter = registry.make_drafter("dflash", target, draft_dir=registry.bundled_dir("dflash"), **kw)
  return target, drafter


def long_prompts(tokenizer: Any, length: int, count: int = 1) -> list[list[int]]:
  """`count` disjoint windows of `length` tokens of the train split's files, concatenated in
  their sorted order (real text, never repeated filler)."""
  from jaxspec.train import data as data_lib  # pylint: disable=import-outside-toplevel

  need, ids = length * count, []
  files = data_lib.corpus_files("train")
  for i in range(0, len(files), 64):
    docs = data_lib.read_documents(files[i : i + 64])
    ids.extend(tokenizer.encode("\n\n".join(docs)))
    if len(ids) >= need:
      break
  if len(ids) < need:
    raise ValueError(f"the train split holds {len(ids)} tokens, fewer than {need}")
  return [ids[j * length : (j + 1) * length] for j in range(count)]


def _engine(target, drafter, max_len: int, kv: str, batch: int = 1, verify: str = "tree"):
  import jaxspec  # pylint: disable=import-outside-toplevel

  cfg = jaxspec.EngineConfig(
    max_len=max_len,
    batch_size=batch,
    use_eos=False,
    kv_format=kv,
    verify=verify,
    tree_budget=FLAGS.tree_budget,
  )
  return jaxspec.SpecEngine(target, drafter, cfg)


def _max_len(context: int, new: int, drafter) -> int:
  return context + new + max(drafter.gamma, FLAGS.tree_budget) + 2


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job_sweep(context: int, kv: str) -> dict[str, Any]:
  """Prefill seconds, decode tokens/s, acceptance and memory at one context and format."""
  from jaxspec import plan  # pylint: disable=import-outside-toplevel

  target, drafter = _models()
  (prompt,) = long_prompts(target.tokenizer, context)
  max_len = _max_len(context, FLAGS.new_tokens, drafter)
  engine = _engine(target, drafter, max_len, kv)
  # Warm-up with the same chunk shape (a long prompt's chunks all compile once).
  chunk = engine.config.prefill_chunk
  warm = prompt if context <= chunk else prompt[: chunk + 1]
  engine.generate([warm], max_new_tokens=4)
  t0 = time.perf_counter()
  out = engine.generate([prompt], max_new_tokens=FLAGS.new_tokens)
  wall = time.perf_counter() - t0
  s = out.stats
  return {
    "context": context,
    "kv_format": kv,
    "max_len": max_len,
    "prefill_s": s.time_to_first_token_s,
    "decode_s": s.decode_time_s,
    "decode_tok_s": (s.tokens_generated - 1) / max(s.decode_time_s, 1e-9),
    "tokens_generated": s.tokens_generated,
    "acceptance_length": s.acceptance_length,
    "target_passes": s.target_passes,
    "wall_s": wall,
    "kv_bytes": plan.decoding_state_bytes(target.config, 1, max_len, kv),
    "drafter_state_bytes": plan.drafter_state_bytes(drafter, 1, max_len),
    "peak_rss_bytes": _peak_rss(),
    "compiles": engine.compile_counts(),
  }


def _pooled_acceptance(window: int | None, context: int, kv: str) -> dict[str, Any]:
  target, drafter = _models(window)
  prompts = long_prompts(target.tokenizer, context, FLAGS.acceptance_prompts)
  new = FLAGS.acceptance_tokens
  max_len = _max_len(context, new, drafter)
  engine = _engine(target, drafter, max_len, kv, batch=len(prompts))
  out = engine.generate(prompts, max_new_tokens=new)
  return {
    "acceptance_length": out.stats.acceptance_length,
    "target_passes": out.stats.target_passes,
    "tokens_generated": out.stats.tokens_generated,
    "tokens": out.tokens,
  }


def job_acceptance(context: int, kv: str) -> dict[str, Any]:
  r = _pooled_acceptance(None, context, kv)
  return {"context": context, "kv_format": kv, **r}


def job_ring(context: int, window: int) -> dict[str, Any]:
  from jaxspec import plan  # pylint: disable=import-outside-toplevel

  r = _pooled_acceptance(window, context, "float")
  _, drafter = _models(window)
  max_len = _max_len(context, FLAGS.acceptance_tokens, drafter)
  state = plan.drafter_state_bytes(drafter, FLAGS.acceptance_prompts, max_len)
  return {"context": context, "window": window, "drafter_state_bytes": state, **r}


def job_fidelity(context: int, kv: str) -> dict[str, Any]:
  """Teacher-forced logits over the tokens after a prefilled context: `kv` against float."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.speculative import step as step_lib  # pylint: disable=import-outside-toplevel

  target, _ = _models()
  n = FLAGS.fidelity_tokens
  (ids,) = long_prompts(target.tokenizer, context + n)
  tokens = jnp.asarray([ids], jnp.int32)
  chunk = 2048
  run_chunk = jax.jit(step_lib.prefill_chunk, static_argnums=(0, 4), donate_argnums=(6,))
  logits = {}
  for fmt in ("float", kv):
    state = target.init_state(1, context + n, fmt)
    lens = jnp.asarray([context], jnp.int32)
    for start in range(0, context, chunk):
      _, _, state, _, _ = run_chunk(
        target.config, target.params, tokens, jnp.int32(start), min(chunk, context), lens, state
      )
    out = target_lib.forward(
      target.config, target.params, tokens[:, context:], jnp.asarray([context]), state
    )
    logits[fmt] = np.asarray(out.logits[0], np.float64)
  lp = {k: v - np.logaddexp.reduce(v, axis=-1, keepdims=True) for k, v in logits.items()}
  kl = np.sum(np.exp(lp["float"]) * (lp["float"] - lp[kv]), axis=-1)
  top1 = np.argmax(logits["float"], -1) == np.argmax(logits[kv], -1)
  return {
    "context": context,
    "kv_format": kv,
    "tokens": n,
    "kl_mean": float(kl.mean()),
    "kl_max": float(kl.max()),
    "top1_agreement": float(top1.mean()),
  }


JOBS = {
  "sweep": job_sweep,
  "acceptance": job_acceptance,
  "fidelity": job_fidelity,
  "ring": job_ring,
}


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def _run_job(kind: str, **args: Any) -> dict[str, Any]:
  """Runs one job in a fresh interpreter (its own peak memory) and returns its result."""
  spec = json.dumps({"kind": kind, "args": args})
  passthrough = [
    FLAGS[name].serialize()
    for name in (
      "new_tokens",
      "tree_budget",
      "acceptance_prompts",
      "acceptance_tokens",
      "fidelity_tokens",
    )
  ]
  cmd = benchmarks.command("long", f"--job={spec}", *passthrough)
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_TAG)]
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"job {spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  result = json.loads(lines[-1][len(RESULT_TAG) :])
  print(f"  {kind} {args}: {time.perf_counter() - t0:.0f} s", flush=True)
  return result


def _load(path: str) -> dict[str, Any]:
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {"sweep": {}, "acceptance": {}, "fidelity": {}, "ring": {}}


def _save(path: str, results: dict[str, Any]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=1)
  os.replace(tmp, path)


def _key(*parts: Any) -> str:
  return "/".join(str(p) for p in parts)


def run(results: dict[str, Any]) -> None:
  contexts = [int(c) for c in FLAGS.contexts]
  formats = list(FLAGS.kv_formats)
  todo = []
  if "sweep" in FLAGS.only:
    todo += [("sweep", dict(context=c, kv=k)) for c in contexts for k in formats]
  if "acceptance" in FLAGS.only:
    todo += [("acceptance", dict(context=FLAGS.acceptance_context, kv=k)) for k in formats]
  if "fidelity" in FLAGS.only:
    todo += [
      ("fidelity", dict(context=int(c), kv=k))
      for c in FLAGS.fidelity_contexts
      for k in formats
      if k != "float"
    ]
  if "ring" in FLAGS.only:
    todo += [("ring", dict(context=FLAGS.ring_context, window=w)) for w in (FLAGS.ring_window, 0)]
  for kind, args in todo:
    results[kind][_key(*args.values())] = _run_job(kind, **args)
    _save(FLAGS.out, results)


def report(results: dict[str, Any]) -> list[str]:
  """The tables, as lines."""
  from jaxspec import plan  # pylint: disable=import-outside-toplevel

  mib = lambda b: f"{b / 2**20:,.1f}"
  lines = []
  rows = sorted(results["sweep"].values(), key=lambda r: (r["context"], r["kv_format"]))
  if rows:
    lines += [
      f"DFlash + DDTree (budget {FLAGS.tree_budget}), bundled target, batch 1, "
      f"{rows[0]['tokens_generated']} new tokens",
      f"{'context':>8} {'kv':>6} {'KV MiB':>9} {'drafter MiB':>12} {'peak RSS MiB':>13} "
      f"{'prefill s':>10} {'decode tok/s':>13} {'τ':>6}",
    ]
    for r in rows:
      lines.append(
        f"{r['context']:>8} {r['kv_format']:>6} {mib(r['kv_bytes']):>9} "
        f"{mib(r['drafter_state_bytes']):>12} {mib(r['peak_rss_bytes']):>13} "
        f"{r['prefill_s']:>10.1f} {r['decode_tok_s']:>13.1f} {r['acceptance_length']:>6.2f}"
      )
    floats = {r["context"]: r for r in rows if r["kv_format"] == "float"}
    for r in rows:
      base = floats.get(r["context"])
      if base and r["kv_format"] != "float":
        lines.append(
          f"  {r['context']} {r['kv_format']}: KV bytes {r['kv_bytes'] / base['kv_bytes']:.4f}"
          f" of float32 (Q4_0 target 4.5/32 = {4.5 / 32:.4f})"
        )
  acc = results["acceptance"]
  if acc:
    base = next((r for r in acc.values() if r["kv_format"] == "float"), None)
    lines.append("\nacceptance length by KV format (pooled over the prompts)")
    for r in sorted(acc.values(), key=lambda r: r["kv_format"]):
      rel = f" ({r['acceptance_length'] / base['acceptance_length'] - 1:+.1%})" if base else ""
      same = ""
      if base and r["kv_format"] != "float":
        eq = [a == b for a, b in zip(r["tokens"], base["tokens"])]
        same = f", outputs equal to float KV's for {sum(eq)}/{len(eq)} prompts"
      lines.append(
        f"  {r['context']} tokens, {r['kv_format']}: τ {r['acceptance_length']:.3f}{rel}{same}"
      )
  fid = results["fidelity"]
  if fid:
    lines.append("\nteacher-forced target fidelity, quantized KV against float32 KV")
    for r in sorted(fid.values(), key=lambda r: (r["context"], r["kv_format"])):
      lines.append(
        f"  {r['context']:>6} tokens, {r['kv_format']:>5}: KL mean {r['kl_mean']:.2e} "
        f"(max {r['kl_max']:.2e}), top-1 agreement {r['top1_agreement']:.1%} "
        f"over {r['tokens']} tokens"
      )
  ring = results["ring"]
  if ring:
    lines.append("\nDFlash feature ring against an unbounded store (float KV)")
    by_window = {r["window"]: r for r in ring.values()}
    full = by_window.get(0)
    for w, r in sorted(by_window.items(), key=lambda x: -x[0]):
      rel = f" ({r['acceptance_length'] / full['acceptance_length'] - 1:+.1%})" if full else ""
      lines.append(
        f"  {r['context']} tokens, window {w or 'unbounded'}: τ {r['acceptance_length']:.3f}"
        f"{rel}, drafter state {plan.human_bytes(r['drafter_state_bytes'])}"
      )
  return lines


def plot(results: dict[str, Any], path: str) -> str | None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  rows = list(results["sweep"].values())
  if not rows:
    return None
  fig, ax = plt.subplots(figsize=(6, 4))
  for kv in sorted({r["kv_format"] for r in rows}):
    pts = sorted((r["context"], r["decode_tok_s"]) for r in rows if r["kv_format"] == kv)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{kv} KV")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode tokens/s")
  ax.set_title("DFlash + DDTree decode speed vs context (bundled, CPU)")
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv: Sequence[str]) -> None:
  del argv
  if FLAGS.job:
    spec = json.loads(FLAGS.job)
    result = JOBS[spec["kind"]](**spec["args"])
    print(RESULT_TAG + json.dumps(result), flush=True)
    return
  results = _load(FLAGS.out)
  run(results)
  if "report" in FLAGS.only:
    print("\n".join(report(results)))
    png = plot(results, os.path.splitext(FLAGS.out)[0] + ".png")
    print(f"\nresults: {FLAGS.out}" + (f"; plot: {png}" if png else ""))
