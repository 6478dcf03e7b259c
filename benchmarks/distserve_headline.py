"""DistServe's headline in simulation: chatbot on OPT-13B, disaggregated vs colocated (vLLM).

The command line of :mod:`pdserve.bench.experiments.distserve_headline`, which holds the logic,
the usage notes and the tests' entry points (``--help`` lists the flags). Results:
docs/benchmarks.md, "DistServe headline in simulation".
"""

from pdserve.bench.experiments.distserve_headline import main

if __name__ == "__main__":
    main()
