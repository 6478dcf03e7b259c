"""The planner's output file runs live as planned: a deployment spec written by ``pdserve
plan``'s own writer (:func:`deployment_file` + ``write_yaml``, naming a catalogue model and a
``simulation:`` section) is served by ``pdserve serve --config FILE --model DIR`` unedited,
with its TP layout, and answers exactly as TP1 does."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pdserve.bench.metrics import SLO
from pdserve.cluster.runtime import build_runtime
from pdserve.llm import LLM
from pdserve.planner.cli import write_yaml
from pdserve.planner.placements import Placement, node_layout, placement_deployment
from pdserve.planner.problem import Problem
from pdserve.planner.search import deployment_file
from pdserve.request import SamplingParams
from pdserve.server.cli import config_from_args, register
from tests.cluster.realstack import assert_pools_clean, serving, tiny_model
from tests.cluster.test_runtime_real import SHORT, TEXT, complete_all, prompts

LAYOUTS = {
    "colocated-tp2": {"strategy": "colocated", "num_instances": 1, "tp": 2, "pp": 1},
    "prefill-tp2-decode-tp1": {"strategy": "disaggregated", "num_prefill": 1, "num_decode": 1,
                               "prefill_tp": 2, "prefill_pp": 1, "decode_tp": 1, "decode_pp": 1,
                               "prefill_token_target": 512},
}
# what the planner's placements pass to placement_deployment (pdserve/planner/placements.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[str]:
    llm = LLM(model_dir, num_kv_blocks=96, max_model_len=256)
    return [o.text for o in llm.generate([*prompts(), TEXT],
                                         SamplingParams(max_tokens=SHORT, temperature=0))]


def planned_file(path: Path, layout: dict) -> Path:
    """The file ``pdserve plan --out`` writes for ``layout`` of the planner's default
    catalogue model (opt-13b) on A100s: the planner's deployment builder and writer."""
    p = Problem(hardware="A100-80GB", slo=SLO(0.25, 0.1), gpus_per_node=4)
    assert not Path(p.model).exists()  # a catalogue key, not a directory
    dep = placement_deployment(p, layout, p.gpus_per_node)
    roles = [("colocated", 1, layout["tp"], 1)] if "tp" in layout else \
        [("prefill", 1, layout["prefill_tp"], 1), ("decode", 1, layout["decode_tp"], 1)]
    lines, _ = node_layout(roles, p.gpus_per_node)
    pl = Placement("planned", "alg1", layout["strategy"], dep, 1.0,
                   sum(tp for _, _, tp, _ in roles), lines)
    plan = SimpleNamespace(problem=p, best=pl)  # what deployment_file/write_yaml read of a Plan
    write_yaml(str(path), deployment_file(plan), plan)  # type: ignore[arg-type]
    return path


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("name", list(LAYOUTS))
async def test_planned_file_serves_live_as_planned(tmp_path: Path, model_dir: str,
                                                   reference: list[str], name: str) -> None:
    f = planned_file(tmp_path / "plan.yaml", LAYOUTS[name])
    spec = yaml.safe_load(f.read_text())
    assert spec["model"] == "opt-13b" and "simulation" in spec and spec["backend"] == "ray"
    cfg = config_from_args(serve_args("--config", str(f), "--model", model_dir,
                                      "--backend", "inproc", "--dtype", "float32",
                                      "--num-kv-blocks", "96", "--max-model-len", "256"))
    planned = [(r["role"], r["tp"]) for r in spec["roles"]]
    assert planned == ([("colocated", 2)] if "colocated" in name else
                       [("prefill", 2), ("decode", 1)])
    assert [(s.role, s.tp) for s in cfg.instance_specs(2048)] == planned  # served as planned
    rt = await build_runtime(cfg)
    assert sorted(i.client.worker.engine.executor.tp  # type: ignore[attr-defined]
                  for i in rt.instances.values()) == sorted(tp for _, tp in planned)
    async with serving(rt) as url:
        assert await complete_all(url, SHORT) == reference
        await assert_pools_clean(rt)


def test_a_planned_catalogue_model_asks_for_its_checkpoint(tmp_path: Path) -> None:
    """Served without ``--model``, the file's catalogue name gets one line saying what to give
    (not "does not exist"), and the file's header shows the command that works."""
    f = planned_file(tmp_path / "plan.yaml", LAYOUTS["prefill-tp2-decode-tp1"])
    assert f"# serve it live: pdserve serve --config {f} --model CHECKPOINT_DIR" in \
        f.read_text()
    with pytest.raises(ValueError, match=r"'opt-13b' is a simulator catalogue entry .* "
                                         r"give --model DIR"):
        config_from_args(serve_args("--config", str(f), "--backend", "inproc"))


def test_settings_a_live_run_cannot_honour_are_said(tmp_path: Path, model_dir: str) -> None:
    """A multi-node ``gpus_per_node`` layout and its ``inter_node_link`` price the simulation;
    live, Ray places the instances: serving such a file says so (one warning), a one-node file
    (which names an inter-node link too) does not."""
    spec = {"model": model_dir, "strategy": "disaggregated", "num_prefill": 2, "num_decode": 1,
            "gpus_per_node": 2, "prefill_tp": 2, "inter_node_link": "eth-25g"}
    f = tmp_path / "two-nodes.yaml"
    f.write_text(yaml.safe_dump(spec))
    with pytest.warns(UserWarning, match=r"inter_node_link=.* and gpus_per_node=2 \(instances "
                                         r"on 3 nodes\) in the spec are simulated only"):
        config_from_args(serve_args("--config", str(f), "--backend", "inproc"))
    one = {"model": model_dir, "strategy": "colocated", "num_instances": 2, "gpus_per_node": 4,
           "inter_node_link": "eth-25g"}  # what a one-node plan file holds
    f.write_text(yaml.safe_dump(one))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_args(serve_args("--config", str(f), "--backend", "inproc"))
