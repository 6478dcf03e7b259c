"""EcoServe's partial disaggregation (PaDG) against NoDG and FuDG, in simulation.

The command line of :mod:`pdserve.bench.experiments.ecoserve`, which holds the logic, the usage
notes and the tests' entry points (``--help`` lists the flags). Results: docs/benchmarks.md,
"EcoServe partial disaggregation (PaDG) in simulation".
"""

import sys

from pdserve.bench.experiments.ecoserve import main

if __name__ == "__main__":
    sys.exit(main())
