"""Soak with client chaos: many mixed requests against the HTTP server over a live in-process
deployment (colocated, and disaggregated 1 prefill + 1 decode), a random share of them cancelled
by the client at a random moment (docs/benchmarks.md, "Serving API: soak").

The command line of :mod:`pdserve.bench.experiments.soak`, which holds the logic, the usage
notes and the tests' entry points (``--help`` lists the flags). Results: docs/benchmarks.md,
"Serving API: soak".
"""

import sys

from pdserve.bench.experiments.soak import main

if __name__ == "__main__":
    sys.exit(main())
