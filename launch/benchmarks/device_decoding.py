"""`bench.py device`: the decoding sections (lossless, cost, speedup) and what runs one section
in its own process."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Optional, Sequence


import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.models import target as target_lib
from jaxspec.profiling import near_ties
from jaxspec.profiling import roofline
from jaxspec.state import DecodingState
from launch.benchmarks import device_checks as checks
from launch.benchmarks import device_qmatmul


# --------------------------------------------------------------------------------------------------
# 3. lossless decoding
# --------------------------------------------------------------------------------------------------


def _lossless(rec: checks.Recorder, sizes: checks.Sizes, dtype: str, labels: Sequence[str]) -> None:
  prec = checks.full_precision if dtype == "float32" else contextlib.nullcontext  # one per thread
  holder: dict = {}

  changes = {} if dtype == "float32" else {"dtype": dtype}
  if dtype == "bfloat16" and jax.default_backend() == "cpu":
    # XLA:checks.CPU has no bf16 x bf16 -> f32 dot for the dense MoE oracle that "auto" picks there
    # for prefill (UNIMPLEMENTED in DotThunk); the gather backend runs.
    changes["moe_backend"] = "gather"

  def load():
    target = checks.bundled_target(**changes)
    holder["target"] = target
    holder["prompts"] = checks.prompt_ids(target, sizes.prompts)
    return dict(
      dtype=target.config.dtype,
      param_dtype=target.config.param_dtype,
      moe_backend=target.config.options.moe_backend,
      scan_layers=target.config.options.scan_layers,
      prompts=len(holder["prompts"]),
      prompt_tokens=[len(p) for p in holder["prompts"]],
    )

  name = "float32 (matmul precision highest)" if dtype == "float32" else "bf16 target.with_options"
  if not rec.run(f"{dtype}/load: {name}", load):
    return
  target, prompts = holder["target"], holder["prompts"]
  cfg = checks.engine_config(len(prompts), sizes.new_tokens)

  def generate(label):
    with prec():
      engine = (
        jaxspec.SpecEngine(target, None, cfg)
        if label == "plain"
        else checks.make_engine(label, target, cfg)
      )
      return engine.generate(prompts, max_new_tokens=sizes.new_tokens)

  # Every engine at once: their compiles overlap; greedy outputs do not depend on timing.
  labels = ("plain",) + tuple(labels)
  t0 = time.perf_counter()
  outs = dict(zip(labels, checks.parallel([functools.partial(generate, l) for l in labels])))
  wall = time.perf_counter() - t0

  def plain():
    if isinstance(outs["plain"], Exception):
      raise outs["plain"]
    with prec():
      holder["gaps"] = near_ties.top2_gaps(target, prompts, outs["plain"].tokens, cfg.max_len)
    gaps = np.concatenate(holder["gaps"]) if holder["gaps"] else np.zeros(0)
    return dict(
      tokens=sum(len(t) for t in outs["plain"].tokens),
      min_top2_gap=float(gaps.min()) if gaps.size else float("nan"),
      engines_wall_s=wall,
    )

  if not rec.run(f"{dtype}/plain", plain):
    return
  for label in labels[1:]:

    def compare(label=label):
      out = outs[label]
      if isinstance(out, Exception):
        raise out
      ref = outs["plain"].tokens
      return checks.agreement(ref, out.tokens, holder["gaps"], checks.TIE_GAP[dtype], out.stats)

    rec.run(f"{dtype}/{label}", compare)


def section_lossless(rec: checks.Recorder, sizes: checks.Sizes, cpu: bool) -> None:
  del cpu
  _lossless(rec, sizes, "float32", sizes.lossless_f32)
  _lossless(rec, sizes, "bfloat16", sizes.lossless_bf16)


# --------------------------------------------------------------------------------------------------
# 4. cost curve
# --------------------------------------------------------------------------------------------------


def _precompile_forwards(
  config: jaxspec.ModelConfig, params: Any, tokens: Sequence[int], max_len: int, position: int
) -> None:
  """Compiles the target forward of every T in `tokens` in checks.parallel threads, as
  roofline.cost_curve will call it (batch 1, state at `position`), so that the curve's
  warm-up finds them compiled. Only time is lost if the call misses these programs."""
  state = jax.eval_shape(
    lambda: DecodingState.create(config, 1, max_len).with_lengths(
      jnp.full((1,), position, jnp.int32)
    )
  )
  start = jax.ShapeDtypeStruct((1,), jnp.int32)

  def compile_one(t):
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
    # pylint: disable-next=protected-access
    return target_lib._forward.lower(config, params, ids, start, state).compile()

  errors = [
    e
    for e in checks.parallel([functools.partial(compile_one, t) for t in tokens])
    if isinstance(e, Exception)
  ]
  if errors:
    raise errors[0]


def _nominal_bandwidth() -> tuple[Optional[str], Optional[float]]:
  kind = jax.devices()[0].device_kind
  for name, value in checks.NOMINAL_BANDWIDTH.items():
    if name.lower() in kind.lower():
      return name, value
  return None, None


def section_cost(rec: checks.Recorder, sizes: checks.Sizes, cpu: bool) -> None:
  del cpu
  m = sizes.cost_model
  base = roofline.dense_config(dtype="bfloat16", **m)
  max_len, position = sizes.cost_max_len, sizes.cost_max_len // 2
  tokens = tuple(sizes.cost_tokens)
  nominal_name, nominal = _nominal_bandwidth()
  state: dict = {}

  def bandwidth():
    bw = roofline.reference_bandwidth(sizes.bandwidth_bytes)
    state["bw"] = bw["best"]
    out = {f"{k}_gb_s": v / 1e9 for k, v in bw.items()}
    if nominal:
      out[f"nominal_{nominal_name}_gb_s"] = nominal / 1e9
      out["best_of_nominal"] = bw["best"] / nominal
    return out

  def draw():
    # Drawn stacked (few, large leaves: a quick compile), split per layer below.
    t0 = time.perf_counter()
    params = jax.block_until_ready(roofline.random_params(base.with_options(scan_layers=True)))
    state["stacked"] = params
    return dict(
      model=f"dense h{m['hidden']} L{m['layers']} i{m['intermediate']} v{m['vocab']} bf16",
      weight_gib=roofline.weight_bytes_read(base, params, 1) / 2**30,
      draw_s=time.perf_counter() - t0,
    )

  def scanned_t1():
    cfg = base.with_options(scan_layers=True)
    (p,) = roofline.cost_curve(
      cfg, state["stacked"], (1,), max_len, position, repeats=sizes.cost_repeats
    )
    state["scan_t1"] = p.seconds
    return dict(ms=1e3 * p.seconds, weight_gb_s=p.weight_bytes / p.seconds / 1e9)

  def unrolled_t1():
    model = jaxspec.TargetModel(base.with_options(scan_layers=True), state.pop("stacked"))
    unrolled = model.with_scan_layers(False)
    del model
    cfg, params = unrolled.config, jax.block_until_ready(unrolled.params)
    state["cfg"], state["params"] = cfg, params
    _precompile_forwards(cfg, params, (1,), max_len, position)
    (p,) = roofline.cost_curve(cfg, params, (1,), max_len, position, repeats=sizes.cost_repeats)
    state["t1"] = p
    out = dict(ms=1e3 * p.seconds, weight_gb_s=p.weight_bytes / p.seconds / 1e9)
    if "scan_t1" in state:
      out["scanned_over_unrolled"] = state["scan_t1"] / p.seconds
    return out

  def roofline_fraction():
    p, bw = state["t1"], state["bw"]
    kv = roofline.kv_bytes_read(state["cfg"], position)
    out = dict(
      of_measured=p.weight_bytes / p.seconds / bw,
      with_kv_of_measured=(p.weight_bytes + kv) / p.seconds / bw,
      measured_gb_s=bw / 1e9,
    )
    if nominal:
      out[f"of_nominal_{nominal_name}"] = p.weight_bytes / p.seconds / nominal
    return out

  def curve():
    cfg, params = state["cfg"], state["params"]
    _precompile_forwards(cfg, params, tokens, max_len, position)
    points = roofline.cost_curve(cfg, params, tokens, max_len, position, repeats=sizes.cost_repeats)
    t1 = points[0].seconds
    return dict(
      position=f"{position}/{max_len}",
      **{f"T{p.tokens}": p.seconds / t1 for p in points},
      t1_ms=1e3 * t1,
      t_max_ms=1e3 * points[-1].seconds,
    )

  rec.run("reference_bandwidth", bandwidth)
  name = "random 8B-shaped params" if sizes is checks.DEVICE else "random tiny params"
  if not rec.run(name, draw):
    return
  rec.run("T=1 scan_layers=True", scanned_t1)
  if not rec.run("T=1 scan_layers=False", unrolled_t1):
    return
  if "bw" in state:
    rec.run("plain decoding: weight bytes/t(1) of bandwidth", roofline_fraction)
  rec.run("t(T)/t(1) scan_layers=False", curve)


# --------------------------------------------------------------------------------------------------
# 5. speedup
# --------------------------------------------------------------------------------------------------


def section_speedup(rec: checks.Recorder, sizes: checks.Sizes, cpu: bool) -> None:
  del cpu
  holder: dict = {}

  def build():
    target = checks.bundled_target()
    prompts = checks.prompt_ids(target, sizes.speed_prompts)
    cfg = checks.engine_config(1, sizes.speed_tokens)
    engines = {
      label: jaxspec.SpecEngine(target, None, cfg)
      if label == "plain"
      else checks.make_engine(label, target, cfg)
      for label in sizes.speed_methods
    }
    t0 = time.perf_counter()
    warm = [
      functools.partial(e.generate, [prompts[0]], max_new_tokens=sizes.speed_tokens)
      for e in engines.values()
    ]
    errors = [e for e in checks.parallel(warm) if isinstance(e, Exception)]
    if errors:
      raise errors[0]
    holder.update(engines=engines, prompts=prompts)
    return dict(
      methods=len(engines),
      prompts=len(prompts),
      new_tokens=sizes.speed_tokens,
      compile_s=time.perf_counter() - t0,
      dtype=target.config.dtype,
    )

  if not rec.run("build + compile", build):
    return
  engines, prompts = holder["engines"], holder["prompts"]
  runs = {label: [] for label in engines}
  # Interleaved prompt by prompt, fastest of the repeats (as launch/bench.py).
  for p in prompts:
    for label, engine in engines.items():
      best = None
      for _ in range(sizes.speed_repeats):
        t0 = time.perf_counter()
        out = engine.generate([p], max_new_tokens=sizes.speed_tokens)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
          best = (seconds, out)
      runs[label].append(best)

  def tok_s(label):
    return sum(len(o.tokens[0]) for _, o in runs[label]) / sum(s for s, _ in runs[label])

  for label in engines:

    def row(label=label):
      tokens = sum(len(o.tokens[0]) for _, o in runs[label])
      passes = sum(o.stats.target_passes for _, o in runs[label])  # verify passes
      accepted = sum(o.stats.acceptance_length * o.stats.target_passes for _, o in runs[label])
      same = all(
        o.tokens == ref.tokens
        for (_, o), (_, ref) in zip(runs[label], runs[sizes.speed_methods[0]])
      )
      return dict(
        tok_s=tok_s(label),
        tokens=tokens,
        accept_len=accepted / max(passes, 1),
        speedup=tok_s(label) / tok_s(sizes.speed_methods[0]),
        same_as_plain=same,
        ms_per_token=1e3 / tok_s(label),
      )

    rec.run(label, row)


SECTION_FNS = {
  "environment": checks.section_environment,
  "pallas": checks.section_pallas,
  "qmatmul": device_qmatmul.section_qmatmul,
  "lossless": section_lossless,
  "cost": section_cost,
  "speedup": section_speedup,
}


def run_section(name: str, rows_file: str, cpu: bool, compile_cache: str) -> None:
  """Child process: one section's checks, rows appended to `rows_file`; `compile_cache`: the
  JAX persistent compilation cache shared by the sections ('' = off)."""
  if compile_cache:
    jax.config.update("jax_compilation_cache_dir", compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  rec = checks.Recorder(name, rows_file)
  sizes = checks.CPU if cpu else checks.DEVICE
  if not cpu and jax.default_backend() == "cpu" and name != "environment":
    rec.row("(section)", "skip", {"reason": "no accelerator; pass --cpu"}, 0.0)
    return
  SECTION_FNS[name](rec, sizes, cpu)


