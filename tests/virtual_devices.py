"""Running a check on several virtual CPU devices, in a fresh interpreter.

XLA's device count is fixed when the backend starts and a test session already runs on one CPU
device, so multi-device checks run as `python -c SCRIPT args...` with
--xla_force_host_platform_device_count and report back one JSON line, the last line printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(script: str, *args: str, devices: int = 8) -> Any:
  """Runs `script` with `args` on `devices` virtual CPU devices; returns its last line, parsed."""
  env = dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  proc = subprocess.run(
    [sys.executable, "-c", script, *args],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
