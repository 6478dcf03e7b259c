"""Routing-decision speed of the prefix-aware routers, and the prefix index's memory.

Builds a global prefix index of ~1 M distinct cached tokens spread over 64 instances (shared
"system" prefixes with several continuations each, every prefix cached on 1–2 instances, every
instance's cache full), then times ``router.select`` per request on a mix of prompts that hit
(exploit) and fresh ones (explore). The E2 router runs its whole decision: expiring the window,
matching, the cost model, recording, rebalancing checks; ``prefix_aware`` its matching, the
promises of prefixes in flight and the cost of every candidate. Between decisions (untimed) the
controller's counts move as they would: each instance keeps ~4 requests before their first
token and ~16 unfinished, the oldest routed reaching theirs first.

    python benchmarks/router_speed.py [--instances 64] [--tokens 1000000] [--requests 20000]

Each prompt's chained block hashes are made once before the timed decisions, as the
controller's :class:`~pdserve.request.Prompt` does where a prompt enters the cluster (the
engines take the same chain); that one-time hashing is timed apart and reported per prompt.

Targets (issue 11): median ≤ 50 µs, P99 ≤ 200 µs for 64 instances and 1 M cached tokens.
Wall-clock times include the OS descheduling this process on a shared machine; the thread CPU
times beside them (``time.thread_time_ns``, clock resolution permitting) do not.

    python benchmarks/router_speed.py --baseline OLD_CHECKOUT [--routers prefix_aware] [--repeats 3]

times the routers of ``pdserve/cluster/prefix_routing.py`` (``preble-paper`` unless
``--routers`` names others) of another checkout (e.g. ``git archive <commit> | tar -x -C
/tmp/old``) against this one's in the same process: both routers get identical indexes and
requests, and each request is routed by both (alternately first), so both see the same machine
load; every request must go to the same instance (the controller's counts move for each as
above). Reports thread CPU time median / P99 per repeat for both, each given each prompt's
chained block hashes (made beforehand, as the controller's :class:`~pdserve.request.Prompt`
does once per prompt for the router and the engines), and that one-time hashing per prompt
apart.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections import deque
from typing import Any

from pdserve.cluster.controller import ClusterRequest
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.routing import InstanceView, make_router
from pdserve.engine.kv_cache import BlockStored
from pdserve.request import NO_PARENT, SamplingParams, Timeline, block_hashes

BS = 16
PREFIX, CONT = 2048, 512  # tokens of a shared prefix and of each continuation
QUEUED, ACTIVE = 4, 16  # requests per instance before their first token / unfinished


def build_corpus(total_tokens: int, rng: random.Random,
                 prefix_len: int = PREFIX) -> list[tuple[list[int], list[list[int]]]]:
    """Shared prefixes with 6 continuations each, ~``total_tokens`` distinct tokens overall."""
    per = prefix_len + 6 * CONT
    out, tok = [], 1
    for _ in range(max(total_tokens // per, 1)):
        prefix = list(range(tok, tok + prefix_len))
        tok += prefix_len
        conts = []
        for _ in range(6):
            conts.append(list(range(tok, tok + CONT)))
            tok += CONT
        out.append((prefix, conts))
    rng.shuffle(out)
    return out


def events_for(tokens: list[int]) -> list[BlockStored]:
    hs = block_hashes(tokens, BS)
    return [BlockStored(hs, NO_PARENT, tokens[:len(hs) * BS], BS)]


def populate(router, corpus, views: list[InstanceView], rng: random.Random) -> None:
    ids = [v.instance_id for v in views]
    for prefix, conts in corpus:
        holders = rng.sample(ids, rng.choice((1, 2)))
        for c in conts:
            router.on_kv_events(rng.choice(holders), events_for(prefix + c))
        for h in holders:
            router.on_kv_events(h, events_for(prefix))


def requests(corpus, n: int, rng: random.Random, explore_share: float, fresh_len: int):
    sp = SamplingParams(max_tokens=128, ignore_eos=True)
    fresh = 10**8
    out = []
    for i in range(n):
        if rng.random() < explore_share:
            prompt = list(range(fresh, fresh + fresh_len))
            fresh += fresh_len
        else:
            prefix, conts = rng.choice(corpus)
            prompt = prefix + rng.choice(conts)[:rng.randrange(0, CONT)] + [7] * 64
        out.append(ClusterRequest(f"r{i}", prompt, sp, Timeline(arrival=i * 0.01)))
    return out


class Counts:
    """The controller's bookkeeping between decisions (untimed): each instance has ~``QUEUED``
    requests before their first token and ~``ACTIVE`` unfinished, the oldest routed reaching
    theirs first."""

    def __init__(self, n_inst: int) -> None:
        self.n_inst = n_inst
        self.to_first: deque[InstanceView] = deque()
        self.to_finish: deque[InstanceView] = deque()

    def routed(self, inst: InstanceView) -> None:
        inst.queued += 1
        inst.active += 1
        self.to_first.append(inst)
        self.to_finish.append(inst)
        if len(self.to_first) > QUEUED * self.n_inst:
            self.to_first.popleft().queued -= 1
        if len(self.to_finish) > ACTIVE * self.n_inst:
            self.to_finish.popleft().active -= 1


def run(name: str, n_inst: int, tokens: int, n_req: int, explore_share: float,
        prefix_len: int = PREFIX, seed: int = 0) -> dict:
    rng = random.Random(seed)
    corpus = build_corpus(tokens, rng, prefix_len)
    distinct = sum(len(p) + sum(len(c) for c in cs) for p, cs in corpus)
    router = make_router(name)
    views = [InstanceView(f"i{k}", "colocated", num_kv_blocks=1, block_size=BS)
             for k in range(n_inst)]
    if getattr(router, "wants_kv_events", False):
        populate(router, corpus, views, rng)
        index: PrefixIndex = router.index
        held = {v.instance_id: index.num_blocks(v.instance_id) for v in views}
        for v in views:  # every cache is exactly full: each miss evicts (Preble's assumption)
            v.num_kv_blocks = max(held[v.instance_id], 1)
    else:
        for prefix, conts in corpus:  # warm the approximate tree with the same prompts
            for c in conts:
                router.select(ClusterRequest("w", prefix + c, SamplingParams(),
                                             Timeline(arrival=0.0)), views)
        index = router.tree
    reqs = requests(corpus, n_req, rng, explore_share, prefix_len)
    hash_cpu = hash_once(reqs)
    times, cpu = [], []
    counts = Counts(n_inst)
    gc.collect()
    gc.disable()
    try:
        for r in reqs:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            inst = router.select(r, views)
            times.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
            counts.routed(inst)
    finally:
        gc.enable()
    cpu.sort()
    match_times = []
    for r in reqs[:2000]:  # the index lookup alone, given the prompt's chain
        t0 = time.perf_counter_ns()
        index.match(r.prompt_token_ids)
        match_times.append(time.perf_counter_ns() - t0)
    times.sort()
    blocks = statistics.mean(len(r.prompt_token_ids) // BS for r in reqs)
    mem = index.memory_bytes()
    return {"router": name, "instances": n_inst, "distinct_cached_tokens": distinct,
            "index_nodes": len(index.nodes), "index_mb": mem / 2**20,
            "bytes_per_block": mem / max(len(index.nodes), 1),
            "median_us": statistics.median(times) / 1e3,
            "p99_us": times[int(0.99 * (len(times) - 1))] / 1e3,
            "match_median_us": statistics.median(match_times) / 1e3,
            "cpu_median_us": cpu[len(cpu) // 2] / 1e3,
            "cpu_p99_us": cpu[int(0.99 * (len(cpu) - 1))] / 1e3,
            "hash_median_us": hash_cpu[len(hash_cpu) // 2] / 1e3,
            "hash_p99_us": hash_cpu[int(0.99 * (len(hash_cpu) - 1))] / 1e3,
            "prompt_blocks": blocks,
            "decisions": getattr(router, "decisions", None)}


def hash_once(reqs: list[ClusterRequest]) -> list[int]:
    """Hash every prompt's blocks once, as where a prompt enters the cluster (the chain is kept
    by the prompt, :class:`~pdserve.request.Prompt`, for the router and the engines): thread CPU
    ns per prompt, sorted."""
    out = []
    gc.collect()
    gc.disable()
    try:
        for r in reqs:
            c0 = time.thread_time_ns()
            block_hashes(r.prompt_token_ids, BS)
            out.append(time.thread_time_ns() - c0)
    finally:
        gc.enable()
    return sorted(out)


def load_baseline(root: str, name: str) -> type:
    """The router class called ``name`` in ``pdserve/cluster/prefix_routing.py`` of the checkout
    at ``root``, loaded beside ours (its prefix index module under another name; its routers
    left out of our registry)."""
    import importlib.util

    def load(name: str, path: str, subs: tuple[tuple[str, str], ...] = ()) -> Any:
        with open(path) as f:
            src = f.read()
        for a, b in subs:
            src = src.replace(a, b)
        spec = importlib.util.spec_from_loader(name, loader=None)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        mod.__file__ = path
        sys.modules[name] = mod
        exec(compile(src, path, "exec"), mod.__dict__)
        return mod

    base = os.path.join(root, "pdserve", "cluster")
    load("baseline_prefix_index", os.path.join(base, "prefix_index.py"))
    mod = load("baseline_prefix_routing", os.path.join(base, "prefix_routing.py"), (
        ("from pdserve.cluster.prefix_index import", "from baseline_prefix_index import"),
        ("@register\n", "")))
    for obj in vars(mod).values():
        if isinstance(obj, type) and getattr(obj, "name", None) == name \
                and obj.__module__ == "baseline_prefix_routing":
            return obj
    raise SystemExit(f"no router {name!r} in {base}/prefix_routing.py")


def compare(baseline: type, name: str, n_inst: int, tokens: int, n_req: int, explore_share: float,
            prefix_len: int, seed: int) -> dict[str, Any]:
    """Thread CPU time per ``select`` of ``baseline()`` and of our router ``name``,
    interleaved."""
    routers = [baseline(), make_router(name)]
    setups = []
    for router in routers:
        rng = random.Random(seed)
        corpus = build_corpus(tokens, rng, prefix_len)
        views = [InstanceView(f"i{k}", "colocated", num_kv_blocks=1, block_size=BS)
                 for k in range(n_inst)]
        populate(router, corpus, views, rng)
        for v in views:
            v.num_kv_blocks = max(router.index.num_blocks(v.instance_id), 1)
        setups.append((views, requests(corpus, n_req, rng, explore_share, prefix_len)))
    hash_once(setups[0][1])  # both get each prompt's chain made beforehand
    hashing = hash_once(setups[1][1])
    counts = [Counts(n_inst), Counts(n_inst)]
    times: list[list[int]] = [[], []]
    chosen: list[list[str]] = [[], []]
    gc.collect()
    gc.disable()
    try:
        for j, (a, b) in enumerate(zip(setups[0][1], setups[1][1])):
            for k, r in ((0, a), (1, b)) if j % 2 else ((1, b), (0, a)):
                c0 = time.thread_time_ns()
                inst = routers[k].select(r, setups[k][0])
                times[k].append(time.thread_time_ns() - c0)
                chosen[k].append(inst.instance_id)
                counts[k].routed(inst)
    finally:
        gc.enable()
    if routers[0].decisions != routers[1].decisions or chosen[0] != chosen[1]:
        diff = sum(a != b for a, b in zip(*chosen))
        raise AssertionError(f"the routers decided differently ({diff} requests elsewhere): "
                             f"{routers[0].decisions} vs {routers[1].decisions}")
    out: dict[str, Any] = {"prompt_blocks": statistics.mean(
        len(r.prompt_token_ids) // BS for r in setups[1][1])}
    for name, t in zip(("baseline", "ours", "hashing"), (*times, hashing)):
        t.sort()
        out[name] = (statistics.median(t) / 1e3, t[int(0.99 * (len(t) - 1))] / 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--explore-share", type=float, default=0.3)
    ap.add_argument("--prefix-tokens", type=int, default=PREFIX,
                    help="length of the shared prefixes (prompts are about this + 350 tokens)")
    ap.add_argument("--routers", help="default: prefix_aware,preble-paper,kv_overlap,"
                    "sglang_cache_aware; with --baseline, preble-paper")
    ap.add_argument("--baseline", metavar="DIR",
                    help="compare the routers with those of the checkout in DIR (module docstring)")
    ap.add_argument("--repeats", type=int, default=3, help="--baseline: runs")
    a = ap.parse_args(argv)
    if a.baseline:
        print(f"python {sys.version.split()[0]}; {a.instances} instances, {a.requests} requests "
              f"({a.explore_share:.0%} fresh prompts); thread CPU time per select, µs")
        for name in (a.routers or "preble-paper").split(","):
            old = load_baseline(a.baseline, name)
            for rep in range(a.repeats):
                r = compare(old, name, a.instances, a.tokens, a.requests, a.explore_share,
                            a.prefix_tokens, seed=rep)
                (bm, bp), (om, op), (hm, hp) = r["baseline"], r["ours"], r["hashing"]
                print(f"{name} repeat {rep}: {r['prompt_blocks']:.0f} prompt blocks | baseline "
                      f"median {bm:6.1f} P99 {bp:6.1f} | ours: median {om:6.1f} P99 {op:6.1f} | "
                      f"ours / baseline: median {om / bm:.2f}, P99 {op / bp:.2f} | hashing "
                      f"the prompt once: median {hm:6.1f} P99 {hp:6.1f} | load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
        return
    print(f"python {sys.version.split()[0]}; {a.instances} instances, "
          f"{a.requests} requests ({a.explore_share:.0%} fresh prompts)")
    for name in (a.routers or "prefix_aware,preble-paper,kv_overlap,sglang_cache_aware").split(","):
        r = run(name, a.instances, a.tokens, a.requests, a.explore_share, a.prefix_tokens)
        print(f"{r['router']:>20}: median {r['median_us']:6.1f} µs  P99 {r['p99_us']:6.1f} µs  "
              f"(thread CPU time: median {r['cpu_median_us']:6.1f} µs  P99 "
              f"{r['cpu_p99_us']:6.1f} µs)  "
              f"| index {r['index_nodes']:,} blocks ({r['distinct_cached_tokens']:,} tokens), "
              f"{r['index_mb']:.1f} MiB, {r['bytes_per_block']:.0f} B/block | match alone "
              f"{r['match_median_us']:.1f} µs for {r['prompt_blocks']:.0f} prompt blocks | "
              f"hashing a prompt once: median {r['hash_median_us']:.1f} µs P99 "
              f"{r['hash_p99_us']:.1f} µs"
              + (f"  decisions {r['decisions']}" if r["decisions"] else ""))


if __name__ == "__main__":
    main()
