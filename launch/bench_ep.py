"""Deprecated: `python launch/bench.py ep` (this script forwards to it with a warning)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec.cli import bench  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  bench.forward("launch/bench_ep.py", "ep")
