"""launch/device_check.py --cpu: the accelerator check script starts and every section reports.

The script itself runs on a lent GPU (docs/benchmarks.md, "On a lent accelerator"); CI has
none, so this runs its CPU smoke mode (tiny shapes, Pallas in interpret mode) in a subprocess,
as a device session would run it, and reads the table it saves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("environment", "pallas", "lossless", "cost", "speedup")
RESULTS = ("pass", "fail", "timeout", "skip")


def test_cpu_smoke_run_reports_every_section(tmp_path):
  out = tmp_path / "out"
  cmd = [
    sys.executable,
    os.path.join(REPO, "launch", "device_check.py"),
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
