"""jaxspec's benchmarks, one command: `python launch/bench.py <subcommand> [flags]`.

  python launch/bench.py --help                 # the subcommands and what each measures
  python launch/bench.py generate --help        # one subcommand's flags
  python launch/bench.py generate --random=small --temperatures=0
  python launch/bench.py cost-curve

The subcommands live in jaxspec/cli/bench/ (a launch script cannot import another one).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec.cli import bench  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  bench.main()
