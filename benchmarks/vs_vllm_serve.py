"""Online serving: ``pdserve serve`` versus ``vllm serve`` (vLLM's CPU build) under the same
``pdserve bench`` workload (issue 14): TTFT, ITL, TPOT and throughput.

The command line of :mod:`pdserve.bench.experiments.vs_vllm_serve`, which holds the logic, the
usage notes and the tests' entry points (``--help`` lists the flags). Results:
docs/benchmarks.md, "Online: pdserve serve vs vllm serve".
"""

import sys

from pdserve.bench.experiments.vs_vllm_serve import main

if __name__ == "__main__":
    sys.exit(main())
