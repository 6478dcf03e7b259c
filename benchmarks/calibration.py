"""Calibrate the analytic model per device and validate it on held-out measurements
(docs/fidelity.md, "Calibrated analytic model").

The command line of :mod:`pdserve.bench.experiments.calibration`, which holds the logic, the
usage notes and the tests' entry points (``--help`` lists the flags). Results: docs/fidelity.md,
"Calibrated analytic model".
"""

from pdserve.bench.experiments.calibration import main

if __name__ == "__main__":
    main()
