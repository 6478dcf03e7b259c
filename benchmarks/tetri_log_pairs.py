"""Log (prompt, generated length) pairs of a served model, the length predictor's training data
(TetriInfer §3.3.2, Figure 8: "send training prompts to the target LLM model, which generates
responses"; docs/benchmarks.md).

Prompts: HumanEval problems, each asked three ways through the model's chat template — a
one-sentence summary, the code only, the code with a detailed explanation — so that the answer
length depends on what the prompt asks, not only on how long it is. The target model generates
greedily (up to ``--max-tokens``) with pdserve's offline ``LLM``; each line of the output JSONL
is ``{"prompt_token_ids": [...], "output_len": n, "task": ..., "ask": ...}``, which
``benchmarks/tetri_predictor.py --traces FILE`` and ``--predictor-data FILE`` read.

    python benchmarks/tetri_log_pairs.py [--model smollm2-135m-instruct] [--problems 100]
        [--max-tokens 300] [--out out/tetri/pairs_smollm2_humaneval.jsonl]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

from pdserve.bench.traces import find_traces_dir
from pdserve.llm import LLM
from pdserve.request import SamplingParams
from pdserve.tokenizer import apply_chat_template

ASKS = {
    "summary": "In one short sentence, say what this Python function should do:\n\n",
    "code": "Complete this Python function. Reply with the code only:\n\n",
    "explain": "Complete this Python function, then explain in detail how it works, with "
               "examples:\n\n",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--problems", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--out", default="out/tetri/pairs_smollm2_humaneval.jsonl")
    args = p.parse_args(argv)
    path = find_traces_dir() / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f][: args.problems]
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=64)
    prompts, meta = [], []
    for r in rows:
        for ask, text in ASKS.items():
            prompts.append(apply_chat_template(llm.tokenizer, [
                {"role": "user", "content": text + r["prompt"]}]))
            meta.append((r["task_id"], ask))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    print(f"{len(outs)} generations in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for ids, o, (task, ask) in zip(prompts, outs, meta):
            f.write(json.dumps({"prompt_token_ids": ids, "output_len": len(o.token_ids),
                                "task": task, "ask": ask}) + "\n")
    for ask in ASKS:
        lens = [len(o.token_ids) for o, m in zip(outs, meta) if m[1] == ask]
        print(f"{ask}: mean output {sum(lens) / len(lens):.0f} tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
