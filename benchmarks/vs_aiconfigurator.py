"""pdserve's planner against NVIDIA aiconfigurator 0.12 on the same questions (issue 28,
deliverable 4): both planners' choices side by side, the adapter check, the long run.

The command line of :mod:`pdserve.bench.experiments.vs_aiconfigurator`, which holds the logic,
the usage notes and the tests' entry points (``--help`` lists the flags). aiconfigurator runs
from its own virtual environment (``--aic-python`` or ``$PDSERVE_AICONFIGURATOR``). Results:
docs/benchmarks.md, "pdserve plan vs aiconfigurator".
"""

import sys

from pdserve.bench.experiments.vs_aiconfigurator import main

if __name__ == "__main__":
    sys.exit(main())
