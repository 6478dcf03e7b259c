"""pdserve.bench.experiments.calibration (benchmarks/calibration.py)'s device measurement path, run
on the CPU as a GPU run would go: two grids timed interleaved, written as sample files, read
back as an experiment of the device named in them; and the CUDA-name → catalogue mapping a GPU
run relies on."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest


def _bench():
    return importlib.import_module("pdserve.bench.experiments.calibration")


@pytest.mark.parametrize("cuda,name", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"), ("NVIDIA B200", "B200"),
])
def test_gpu_catalogue_name(cuda: str, name: str) -> None:
    from pdserve.sim.hardware import get_device

    assert _bench().gpu_catalogue_name(cuda) == name
    get_device(name)  # and the catalogue has it


def test_unknown_gpu_asks_for_the_flag() -> None:
    with pytest.raises(SystemExit, match="--gpu-hardware"):
        _bench().gpu_catalogue_name("Tesla T4")


def test_measured_grids_become_a_held_out_experiment(tmp_path: Path) -> None:
    from pdserve.model.tiny import default_model_dir

    bench = _bench()
    bench.measure_grids(default_model_dir(), str(tmp_path), "gpu", "cpu", "float32", "cpu", 1,
                        "test")
    fit = json.loads((tmp_path / "gpu_fit.json").read_text())
    held = json.loads((tmp_path / "gpu_heldout.json").read_text())
    assert fit["hardware"] == "cpu" and len(fit["samples"]) == 63
    assert len(held["samples"]) == 34
    args = argparse.Namespace(profiles=str(tmp_path / "none"), cpu_dir=[], gpu_dir=[str(tmp_path)],
                              cpu_model=None, loo=False)
    # only the GPU-dir experiment (the published profiles are not needed for it)
    exps = bench.experiments_of_dirs(args)
    assert [(e[0], e[4][0].dtype, len(e[4]), len(e[5])) for e in exps] == [
        ("cpu", "float32", 63, 34)]
