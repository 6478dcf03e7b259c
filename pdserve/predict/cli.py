"""``pdserve predictor train | eval``: fit the output-length classifier on logged pairs and report
its accuracy (TetriInfer §3.3.2, Figure 8: the target model's own (prompt, generated length)
pairs train the predict model, which is then evaluated per bucket on held-out pairs).

``train`` splits the pairs (seeded, ``--eval-share`` held out as the paper does), fits the
classifier on the rest, saves it (``--output FILE.npz``, what ``--length-predictor classifier
--predictor-data FILE.npz`` loads) and prints, beside the two baselines fitted on the same split
(``majority``: no information; ``prompt-length``: the prompt's log2 length class), the accuracy
of the exact bucket, within one bucket, per true bucket, and the cost of one prediction.
``eval`` reports the same for a saved classifier on other pairs (say, freshly logged ones).

Pairs come from ``pdserve serve --log-length-pairs FILE`` (JSONL of ``prompt_token_ids``,
``output_len``), ``benchmarks/tetri_log_pairs.py``, or a length trace of ``shared/traces`` by
name (lengths only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.flags import (
    nonnegative_int,
    one_line_errors,
    output_file,
    positive_int,
    say,
    subcommand,
)
from pdserve.predict import SoftmaxClassifier
from pdserve.predict.data import fit_predictor, load_pairs
from pdserve.predict.train import accuracy_table, evaluate, split


def _eval_share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return v


def _train(args: argparse.Namespace) -> int:
    if not args.output.endswith(".npz"):
        raise ValueError(f"--output must name a .npz file, got {args.output!r}")
    pairs = load_pairs(args.data)
    if len(pairs) < 2 and args.eval_share > 0:
        raise ValueError(f"{args.data!r} holds {len(pairs)} pair(s): too few to hold some out "
                         f"(use --eval-share 0 to train on all)")
    train, test = split(pairs, args.eval_share, args.seed) if args.eval_share > 0 else (pairs,
                                                                                         None)
    clf = fit_predictor("classifier", args.granularity, train, num_buckets=args.num_buckets,
                        seed=args.seed)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    clf.save(args.output)
    tokens = "lengths only" if all(p is None for p in pairs.prompts) else "prompt token ids"
    say(f"pdserve predictor: classifier (granularity {args.granularity}, "
        f"{clf.num_buckets} buckets) fitted on {len(train)} pairs ({tokens}), saved to "
        f"{args.output}")
    if test is None:
        return 0
    results = [evaluate(fit_predictor(name, args.granularity, train,
                                      num_buckets=args.num_buckets, seed=args.seed), test)
               for name in ("majority", "prompt-length")]
    results.append(evaluate(clf, test))
    print(f"{len(test)} held-out pairs (seed {args.seed}):")
    print(accuracy_table(results))
    return 0


def _eval(args: argparse.Namespace) -> int:
    clf = SoftmaxClassifier.load(args.model)
    pairs = load_pairs(args.data)
    if not len(pairs):
        raise ValueError(f"{args.data!r} holds no pairs")
    print(f"{len(pairs)} pairs, classifier {args.model} (granularity {clf.granularity}):")
    print(accuracy_table([evaluate(clf, pairs)]))
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "predictor", help="train and evaluate the output-length predictor (TetriInfer)",
        description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="predictor_command", required=True, metavar="ACTION")
    t = subcommand(sub, "train", _train, cmd="predictor train",
                   help="fit the classifier on logged pairs, save it, report its held-out "
                        "accuracy against the baselines")
    t.add_argument("--data", required=True, metavar="FILE.jsonl|TRACE",
                   help="logged pairs (pdserve serve --log-length-pairs) or a trace name")
    t.add_argument("--granularity", type=positive_int, default=200, metavar="TOKENS",
                   help="bucket width (the paper: 100, 200 or 400) (default: %(default)s)")
    t.add_argument("--num-buckets", type=positive_int, default=None,
                   help="classes; longer outputs fall into the last (default: 2048 tokens' "
                        "worth)")
    t.add_argument("--output", required=True, type=output_file, metavar="FILE.npz",
                   help="the saved classifier")
    t.add_argument("--eval-share", type=_eval_share, default=0.2, metavar="SHARE",
                   help="share of pairs held out for evaluation; 0 trains on all "
                        "(default: %(default)s)")
    t.add_argument("--seed", type=nonnegative_int, default=0)
    e = subcommand(sub, "eval", _eval, cmd="predictor eval",
                   help="accuracy per bucket and cost of a saved classifier")
    e.add_argument("--data", required=True, metavar="FILE.jsonl|TRACE")
    e.add_argument("--model", required=True, metavar="FILE.npz",
                   help="a classifier saved by `pdserve predictor train`")
    one_line_errors(p)
    return p
