"""Simulator fidelity: the live pdserve server on this machine vs the simulator driven by a profile
fitted on this machine, for the same workload at several rates (DESIGN.md "Simulator"; DistServe
Table 2 does the same for its simulator).

The command line of :mod:`pdserve.bench.experiments.fidelity`, which holds the logic, the usage
notes and the tests' entry points (``--help`` lists the flags). Results: docs/fidelity.md, "End
to end".
"""

from pdserve.bench.experiments.fidelity import main

if __name__ == "__main__":
    main()
