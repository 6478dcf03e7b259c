"""The benchmark experiments whose logic the tests exercise, one module each (harness).

``benchmarks/<name>.py`` is each one's command line (``python benchmarks/<name>.py --help``);
``benchmarks/README.md`` says what each answers and where its current result is recorded. Nothing
here is imported by ``pdserve.bench`` itself, so the toolkit stays free of the simulator.
"""
