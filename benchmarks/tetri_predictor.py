"""Output-length predictor accuracy (TetriInfer §3.3.2, §5.2.2; docs/benchmarks.md).

Trains each predictor on 80 % of a trace's (prompt, output length) pairs and evaluates on the
other 20 % (seeded split), at granularities 100, 200 and 400 tokens: exact-bucket accuracy,
within-one-bucket accuracy, accuracy per true bucket, and the cost of one prediction (mean over
200 single-request calls) next to the main model's prefill of the median prompt (OPT-13B on
DistServe's A100 profile). Predictors: ``majority`` (no information), ``prompt-length`` (log2
length class), ``classifier`` (numpy softmax regression, pdserve/predict/classifier.py) and the
simulations' ``oracle`` at the paper's 74.9 %.

    python benchmarks/tetri_predictor.py [--traces sharegpt humaneval] [--save-classifier F]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # small matrices: threads only contend

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from pdserve.predict import Oracle  # noqa: E402
from pdserve.predict.data import fit_predictor, load_pairs  # noqa: E402
from pdserve.predict.train import accuracy_table, evaluate, split  # noqa: E402
from pdserve.sim.latency import FittedProfile  # noqa: E402
from pdserve.sim.target import resolve_profile  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", nargs="+", default=["sharegpt", "humaneval"])
    p.add_argument("--granularities", type=int, nargs="+", default=[100, 200, 400])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-classifier", metavar="FILE.npz",
                   help="save the classifier of the first trace at granularity 200")
    args = p.parse_args(argv)
    prof = FittedProfile.load(resolve_profile("distserve_profiler-a100-80g.distserve"),
                              "opt-13b", 1)
    for trace in args.traces:
        pairs = load_pairs(trace)
        train, test = split(pairs, 0.2, args.seed)
        med = int(np.median(pairs.prompt_lens))
        prefill = prof.prefill_time([med])
        results = []
        for g in args.granularities:
            for name in ("majority", "prompt-length", "classifier"):
                pred = fit_predictor(name, g, train, seed=args.seed)
                results.append(evaluate(pred, test))
                if args.save_classifier and name == "classifier" and g == 200 and \
                        trace == args.traces[0]:
                    pred.save(args.save_classifier)
            results.append(evaluate(Oracle(g, 0.749, args.seed), test))
            print(f"{trace} g={g} done", file=sys.stderr)
        tokens = ("lengths only" if pairs.prompts[0] is None else "prompt token ids"
                  if os.path.isfile(trace) else "prompt bytes as tokens")
        print(f"\n**{trace}** ({len(train)} train / {len(test)} eval pairs, {tokens}; main "
              f"model's prefill of the median prompt ({med} tokens), OPT-13B A100: "
              f"{prefill * 1e3:.1f} ms)\n")
        print(accuracy_table(results))


if __name__ == "__main__":
    main()
