"""jaxspec's benchmarks, one command: `python launch/bench.py <subcommand> [flags]`.

  python launch/bench.py --help                 # the subcommands and what each measures
  python launch/bench.py generate --help        # one subcommand's flags
  python launch/bench.py generate --random=small --temperatures=0
  python launch/bench.py cost-curve

The subcommands live in the package launch/benchmarks/ (every launch/*.py is a binary of its
own; a package under launch/ is a library the scripts share). The repository root goes on
sys.path first, so that `launch.benchmarks` imports from any working directory.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import benchmarks  # pylint: disable=wrong-import-position

if __name__ == "__main__":
  benchmarks.main()
