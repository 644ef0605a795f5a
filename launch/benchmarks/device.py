"""Check jaxspec on a lent accelerator in one command: one table of pass/fail/timeout/skip rows.

  python launch/bench.py device --out=$OUT           # on the GPU machine, < 5 minutes
  python launch/bench.py device --cpu --out=/tmp/dc  # smoke run: CPU, tiny shapes

Sections, each in a subprocess of its own with its own time limit, so that a hang, a crash or a
slow compile in one becomes a row ("timeout" or "fail") and the next section still runs:

1. environment: library versions, backend, device kind, memory (`device.memory_stats()`).
2. pallas: every kernel under pallas_kernels/ compiled for the device (interpret mode only with
   --cpu) against its jnp reference, float32 and bf16 (and FP8 cache) shapes, under the Triton
   lowering (each kernel pins it); then the model path, `attention_impl="pallas"` against "xla"
   on the bundled target (prefill + a tree-verify block, and a DDTree generation).
3. qmatmul (quantized matmuls): pallas_kernels.qmatmul for float, FP8, FP8 block and MXFP4
   weights of 4096 × 14336 at M = 1, 4, 16, 32 rows, impl="xla" against the platform's Pallas
   kernel (errors reported in the row): agreement, µs and stored bytes per second
   (device_qmatmul.py).
4. lossless: greedy speculative decoding equals plain decoding on the bundled models, in
   float32 with full-precision matmuls (chain: EAGLE-3, DFlash, MTP, draft model; tree: DFlash
   + DDTree), and in bf16 up to each sequence's first near-tie (top-2 logit gap < 1e-2).
5. cost: t(T) / t(1) of one forward of a random 8B-shaped dense model in bf16 (Qwen3-8B
   proportions) at a mid-cache position, T = 1 … 64, per-layer weight buffers (and T = 1 with
   scanned layers), and plain decoding's fraction of the measured memory bandwidth.
6. speedup: tokens/s and acceptance length of plain, EAGLE-3 (chain) and DFlash + DDTree on the
   bundled models.

Each row: section, check, result, numbers, seconds. The table is printed and saved under --out
as device_check.json and device_check.md, with the sections' own output in device_check.log.
Exit status 1 when a row failed. Compiled programs are kept in --compile_cache, so a rerun on a
warm machine (and a section that builds the same engine as an earlier one) skips compilation.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from absl import flags

import jaxspec
from launch import benchmarks
from launch.cli import common_flags
from launch.benchmarks import device_checks as checks
from launch.benchmarks import device_decoding


SECTIONS = checks.SECTIONS
RESULTS = ("pass", "fail", "timeout", "skip")
# Nominal time limits (s) per section. They sum to under the default budget, and time a
# section leaves unused goes to the later ones (see `_section_limit`).
DEVICE_LIMITS = {
  "environment": 30, "pallas": 60, "qmatmul": 30, "lossless": 80, "cost": 70, "speedup": 40
}
CPU_LIMITS = {
  "environment": 60, "pallas": 90, "qmatmul": 30, "lossless": 120, "cost": 90, "speedup": 90
}
DEVICE_BUDGET_S = 285  # the whole run: 5 minutes on one GPU, less a margin
CPU_BUDGET_S = 400

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_bool("cpu", False, "Smoke mode: every section on CPU with tiny shapes (< 1 minute).")
  common_flags.define_out(
    None, "a folder for device_check.{json,md,log} (default: $OUT if set, else /tmp/device_check)"
  )
  flags.DEFINE_list(
    "sections", list(checks.SECTIONS), f"Sections to run, of {', '.join(checks.SECTIONS)}."
  )
  flags.DEFINE_integer(
    "budget_s",
    None,
    f"Seconds for the whole run (default {DEVICE_BUDGET_S}; --cpu {CPU_BUDGET_S}).",
  )
  flags.DEFINE_list(
    "limits",
    [],
    "Per-section time limits (s) overriding the defaults, e.g. cost=90,lossless=60. A section "
    "may also use the time earlier ones left unused; the run never exceeds the sum of the "
    "selected sections' limits, nor --budget_s.",
  )
  flags.DEFINE_string(
    "compile_cache",
    "/tmp/jaxspec_device_check_cache",
    "JAX persistent compilation cache shared by the sections ('' = off).",
  )
  flags.DEFINE_enum(
    "section", None, checks.SECTIONS, "Internal: run this one section in this process."
  )
  flags.DEFINE_string("rows_file", None, "Internal: where --section appends its rows (JSON lines).")


# --------------------------------------------------------------------------------------------------
# The parent: sections as subprocesses, time limits, the table
# --------------------------------------------------------------------------------------------------


def _section_limit(i: int, names: Sequence[str], limits: dict, remaining: float) -> float:
  """Section i's limit: at least its nominal one, plus whatever earlier sections left unused,
  keeping the later sections' nominal limits in reserve; never past the remaining budget."""
  reserve = sum(limits[n] for n in names[i + 1 :])
  return min(remaining, max(limits[names[i]], remaining - reserve))


def _read_rows(path: str) -> tuple[list[dict], Optional[tuple[str, float]]]:
  """(rows, the check started but not finished, with its start time) from a rows file."""
  rows, open_check = [], None
  if not os.path.exists(path):
    return rows, None
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        obj = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short by a kill
      if "start" in obj:
        open_check = (obj["start"], obj["t"])
      elif "row" in obj:
        rows.append(obj["row"])
        if open_check and open_check[0] == obj["row"]["check"]:
          open_check = None
  return rows, open_check


def _run_child(name: str, limit: float, work: str, log: Any, cpu: bool) -> tuple[list[dict], dict]:
  """Runs one section in a subprocess; a timeout or a crash becomes a row."""
  rows_file = os.path.join(work, f"rows_{name}.jsonl")
  cmd = benchmarks.command(
    "device",
    f"--section={name}",
    f"--rows_file={rows_file}",
    f"--compile_cache={FLAGS.compile_cache}",
    *(["--cpu"] if cpu else []),
  )
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if cpu:
    # Smoke mode checks that everything runs, not how fast: XLA:CPU's cheapest codegen
    # compiles the engines about a third faster.
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
  log.write(f"\n===== {name} (limit {limit:.0f} s) =====\n")
  log.flush()
  t0 = time.perf_counter()
  # A process group of its own (not a session: whatever stops this script stops it too), so
  # that a timeout also ends what the section started (say, a compiler).
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=os.setpgrp)
  timed_out = False
  try:
    proc.wait(timeout=limit)
  except subprocess.TimeoutExpired:
    timed_out = True
  finally:  # also on Ctrl-C or SIGTERM of this script
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)  # the section's process group only
      proc.wait()
  seconds = time.perf_counter() - t0
  rows, open_check = _read_rows(rows_file)
  check = open_check[0] if open_check else "(section)"
  since = time.time() - open_check[1] if open_check else seconds
  if timed_out:
    rows.append(
      dict(
        section=name,
        check=check,
        result="timeout",
        numbers={"limit_s": round(limit)},
        seconds=round(since, 3),
      )
    )
  elif proc.returncode != 0 or open_check or not rows:
    error = f"exit status {proc.returncode}" + ("" if rows else ", no rows")
    rows.append(
      dict(section=name, check=check, result="fail", numbers={"error": error}, seconds=since)
    )
  return rows, dict(limit_s=round(limit), seconds=round(seconds, 2), exit=proc.returncode)


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  if isinstance(value, (list, tuple)):
    return "[" + ",".join(_fmt(v) for v in value) + "]"
  return str(value)


def _numbers_text(numbers: dict) -> str:
  return ", ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())


def format_table(rows: Sequence[dict]) -> str:
  """The rows as a fixed-width text table."""
  head = ("section", "check", "result", "numbers", "seconds")
  body = [
    (r["section"], r["check"], r["result"], _numbers_text(r["numbers"]), f"{r['seconds']:.1f}")
    for r in rows
  ]
  widths = [max(len(x[i]) for x in [head] + body) for i in range(4)]
  lines = []
  for cells in [head] + body:
    lines.append(
      "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths))
      + "  "
      + cells[4].rjust(7)
      + "  "
      + cells[3]
    )
  lines.insert(1, "-" * min(160, max(len(l) for l in lines)))
  return "\n".join(lines)


def format_markdown(rows: Sequence[dict], header: str) -> str:
  esc = lambda s: str(s).replace("|", "\\|")
  lines = [header, "", "| section | check | result | numbers | s |", "|---|---|---|---|---:|"]
  for r in rows:
    lines.append(
      f"| {esc(r['section'])} | {esc(r['check'])} | {r['result']} | "
      f"{esc(_numbers_text(r['numbers']))} | {r['seconds']:.1f} |"
    )
  return "\n".join(lines) + "\n"


def _parse_limits(cpu: bool) -> dict[str, float]:
  limits = dict(CPU_LIMITS if cpu else DEVICE_LIMITS)
  for item in FLAGS.limits:
    name, eq, value = item.partition("=")
    if not eq or name not in limits:
      raise jaxspec.ConfigError(
        f"--limits={item!r}: expected section=seconds, of {checks.SECTIONS}"
      )
    try:
      limits[name] = float(value)
    except ValueError:
      raise jaxspec.ConfigError(f"--limits={item!r}: {value!r} is not a number") from None
  return limits


def _terminated(signum: int, frame: Any) -> None:
  del signum, frame
  raise KeyboardInterrupt("terminated")


def _skip_row(section: str, reason: str) -> dict:
  return dict(
    section=section, check="(section)", result="skip", numbers={"reason": reason}, seconds=0.0
  )


def _write_report(out_dir: str, report: dict) -> str:
  """Writes device_check.json and .md (after every section, so a killed run leaves its rows);
  returns the header line."""
  mode = "CPU smoke run" if report["mode"] == "cpu" else "device run"
  header = (
    f"jaxspec device check, {report['started']}, {mode}, "
    f"{report['total_seconds']:.0f} s of a {report['budget_s']:.0f} s budget"
  )
  with open(os.path.join(out_dir, "device_check.json"), "w", encoding="utf-8") as f:
    json.dump(checks.jsonable(report), f, indent=1)
  with open(os.path.join(out_dir, "device_check.md"), "w", encoding="utf-8") as f:
    f.write(format_markdown(report["rows"], header))
  return header


def main(argv: Sequence[str]) -> None:
  del argv
  cpu = FLAGS.cpu
  if FLAGS.section:
    if not FLAGS.rows_file:
      raise jaxspec.ConfigError("--section needs --rows_file")
    device_decoding.run_section(FLAGS.section, FLAGS.rows_file, cpu, FLAGS.compile_cache)
    return
  signal.signal(signal.SIGTERM, _terminated)  # end the running section too
  names = [s for s in checks.SECTIONS if s in FLAGS.sections]
  unknown = sorted(set(FLAGS.sections) - set(checks.SECTIONS))
  if unknown:
    raise jaxspec.ConfigError(
      f"--sections: unknown {unknown}; choose from {', '.join(checks.SECTIONS)}"
    )
  limits = _parse_limits(cpu)
  budget = FLAGS.budget_s or (CPU_BUDGET_S if cpu else DEVICE_BUDGET_S)
  budget = min(budget, sum(limits[n] for n in names))
  out_dir = FLAGS.out or os.environ.get("OUT") or "/tmp/device_check"
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  report = dict(
    started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    mode="cpu" if cpu else "device",
    total_seconds=0.0,
    budget_s=budget,
    argv=sys.argv[1:],
    sections={},
    rows=[],
  )
  rows = report["rows"]
  work = tempfile.mkdtemp(prefix="device_check_")  # the sections' row files
  try:
    with open(os.path.join(out_dir, "device_check.log"), "w", encoding="utf-8") as log:
      for i, name in enumerate(names):
        remaining = budget - (time.perf_counter() - t_start)
        limit = _section_limit(i, names, limits, remaining)
        if limit < 1:
          rows.append(_skip_row(name, f"budget of {budget:.0f} s spent"))
          continue
        got, report["sections"][name] = _run_child(name, limit, work, log, cpu)
        rows += got
        counts = {r: sum(x["result"] == r for x in got) for r in checks.RESULTS}
        print(
          f"{name}: {report['sections'][name]['seconds']:.1f} s of {limit:.0f}; "
          + ", ".join(f"{v} {k}" for k, v in counts.items() if v),
          flush=True,
        )
        report["total_seconds"] = round(time.perf_counter() - t_start, 2)
        _write_report(out_dir, report)
        backend = next((r["numbers"].get("backend") for r in got if r["check"] == "backend"), 0)
        if name == "environment" and backend == "cpu" and not cpu:
          print("no accelerator found: the other sections are skipped (--cpu runs them)")
          rows += [_skip_row(later, "no accelerator; pass --cpu") for later in names[i + 1 :]]
          break
  finally:
    shutil.rmtree(work, ignore_errors=True)
  report["total_seconds"] = round(time.perf_counter() - t_start, 2)
  header = _write_report(out_dir, report)
  print()
  print(header)
  print(format_table(rows))
  print(f"saved {out_dir}/device_check.{{json,md,log}}")
  if any(r["result"] == "fail" for r in rows):
    sys.exit(1)

