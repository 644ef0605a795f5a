"""`launch/bench.py device --cpu`: the accelerator check starts and every section reports.

The script itself runs on a lent GPU (docs/benchmarks.md, "On a lent accelerator"); CI has
none, so this runs its CPU smoke mode (tiny shapes, Pallas in interpret mode) in a subprocess,
as a device session would run it, and reads the table it saves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxspec.profiling import near_ties

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("environment", "pallas", "qmatmul", "lossless", "cost", "speedup")
RESULTS = ("pass", "fail", "timeout", "skip")


@pytest.mark.slow  # ~130 s on 2 shared cores: run it before spending device time
def test_cpu_smoke_run_reports_every_section(tmp_path):
  out = tmp_path / "out"
  cmd = [
    sys.executable,
    os.path.join(REPO, "launch", "bench.py"),
    "device",
    "--cpu",
    f"--out={out}",
    f"--compile_cache={tmp_path / 'cache'}",
    # The script stops its sections before this test's timeout. About 60 s on an idle 2-core
    # machine; the margin is for a CI machine whose cores another test worker shares.
    "--budget_s=300",
  ]
  env = {k: v for k, v in os.environ.items() if k != "OUT"}
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
  log = out / "device_check.log"
  detail = proc.stdout[-4000:] + proc.stderr[-2000:]
  if log.exists():
    detail += "\n--- device_check.log ---\n" + log.read_text()[-4000:]
  assert proc.returncode == 0, detail

  report = json.loads((out / "device_check.json").read_text())
  assert report["mode"] == "cpu"
  rows = report["rows"]
  for row in rows:
    assert set(row) == {"section", "check", "result", "numbers", "seconds"}, row
    assert row["result"] in RESULTS, row
  assert [s for s in SECTIONS if any(r["section"] == s for r in rows)] == list(SECTIONS)
  bad = [r for r in rows if r["result"] in ("fail", "timeout")]
  assert not bad, bad
  for section in SECTIONS:  # each section did run checks, not only skip
    assert any(r["section"] == section and r["result"] == "pass" for r in rows), section
  # The lossless checks compared tokens (float32 and bf16) and the printed table lists them.
  compared = [r for r in rows if r["section"] == "lossless" and "compared" in r["numbers"]]
  assert {r["check"].split("/")[0] for r in compared} == {"float32", "bfloat16"}
  assert all(r["numbers"]["compared"] > 0 for r in compared)
  assert "lossless" in proc.stdout and "float32/dflash-ddtree22" in proc.stdout
  assert (out / "device_check.md").read_text().count("\n| ") == len(rows) + 1


def test_greedy_agreement_compares_up_to_the_first_near_tie():
  """The comparison the lossless section shares with the tests (jaxspec/profiling/near_ties.py):
  a difference at or after a sequence's first near-tie passes, one before it fails."""
  gaps = np.array([0.5, 0.2, 1e-4, 0.3])
  assert near_ties.first_near_tie(gaps) == 2  # below LOGIT_GAP (1e-3)
  assert near_ties.first_near_tie(gaps, threshold=1e-5) == 4
  reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
  after_tie = near_ties.greedy_agreement(reference, [[1, 2, 9, 9], [5, 6, 7, 8]], [2, 4])
  assert after_tie.ok and after_tie.exact == 1 and after_tie.first_diff == (2, -1)
  assert (after_tie.compared, after_tie.tokens, after_tie.sequences) == (6, 8, 2)
  before_tie = near_ties.greedy_agreement(reference, [[1, 9, 3, 4], [5, 6, 7]], [2, 4])
  assert not before_tie.ok and before_tie.first_diff == (1, 3)


def test_qmatmul_section_operands_hold_the_weight():
  """The qmatmul section's operands (launch/benchmarks/device_qmatmul.py) are the weight in
  each format: what qmatmul's oracle dequantizes is w up to the format's rounding."""
  import jax  # pylint: disable=import-outside-toplevel

  from launch.benchmarks import device_qmatmul  # pylint: disable=import-outside-toplevel
  from pallas_kernels.qmatmul import check_inputs, dequantize  # pylint: disable=import-outside-toplevel

  w = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (256, 384))
  x = np.ones((2, 256), np.float32)
  for fmt, tol in (("float", 0.0), ("fp8", 0.07), ("fp8_block", 0.07), ("mxfp4", 0.3)):
    values, scales = device_qmatmul.quantized_operands(w, fmt, (128, 128))
    assert check_inputs(x, values, scales, fmt) == (2, 256, 384)
    got = np.asarray(dequantize(values, scales, fmt))
    err = np.linalg.norm(got - np.asarray(w)) / np.linalg.norm(np.asarray(w))
    assert err <= tol, (fmt, err)
  assert device_qmatmul.kernel_impls("gpu") == (("pallas", False),)
  assert device_qmatmul.kernel_impls("tpu") == (("pallas_tpu", False),)
