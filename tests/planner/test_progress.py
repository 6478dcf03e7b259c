"""Long planner commands say what they do: plain progress lines on a stderr that is not a
terminal (a pipe, CI, pytest's capture), one per phase unit and, for ``advise``, one per grid
cell with an ETA; nothing with ``--no-progress``."""

from __future__ import annotations

import json
import re

from pdserve.cli import main

ARGS = ["--model", "opt-13b", "--gpus-per-node", "1", "--workload", "fixed:input=256,output=4",
        "--slo-ttft", "1", "--slo-tpot", "0.2", "--num-requests", "30", "--max-probes", "3",
        "--strategies", "colocated"]


def test_advise_prints_a_line_per_cell_with_an_eta(const_profile, capsys):
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    assert main(["advise", "--profile", prof, *ARGS, "--slo-scales", "1,2",
                 "--output-scales", "1"]) == 0
    err = capsys.readouterr().err
    cells = re.findall(r"^cell (\d)/2 done in \d+ s: SLO x([^,]+), output x1: .*ETA (\d+) s$",
                       err, re.M)
    # the two cells run side by side: either may finish first
    assert [c for c, _, _ in cells] == ["1", "2"] and {s for _, s, _ in cells} == {"1", "2"}
    assert cells[-1][2] == "0"  # nothing left after the last cell
    started = re.findall(r"^cell (\d)/2: SLO x([^,]+), output x1: 2 phase units$", err, re.M)
    assert sorted(started) == [("1", "1"), ("2", "2")] or sorted(started) == [("1", "2"),
                                                                             ("2", "1")]
    assert len(re.findall(r"^  unit \d+: colocated TP1 PP1 ", err, re.M)) == 4
    # each cell's end (its leaders confirmed over a long probe, rule 7) says what it does
    confirming = re.findall(r"^  SLO x([^,]+), output x1: confirming over 5 x the probe length: "
                            r"colocated 1x\(TP1 PP1", err, re.M)
    assert sorted(confirming) == ["1", "2"]


def test_plan_prints_its_units_and_stages_without_cells(const_profile, capsys):
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    assert main(["plan", "--profile", prof, *ARGS]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^plan: 2 phase units$", err, re.M) and "cell" not in err
    assert len(re.findall(r"^  unit \d: colocated TP1 PP1 ", err, re.M)) == 2
    assert re.search(r"^  confirming over 5 x the probe length: colocated 1x\(TP1 PP1", err,
                     re.M)


def test_no_progress_is_silent(const_profile, capsys):
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    assert main(["plan", "--profile", prof, *ARGS, "--no-progress"]) == 0
    assert "unit" not in capsys.readouterr().err


def test_advise_cells_side_by_side_give_the_grid_of_one_at_a_time(const_profile, tmp_path):
    """``--workers 2`` plans cells side by side (threads, a process pool each), ``--workers 1``
    one after another in this process: the same grid, cell for cell, in the same order."""
    prof = const_profile({1: 60.0}, decode_ms=20.0)
    grids = []
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}.json"
        assert main(["advise", "--profile", prof, *ARGS, "--slo-scales", "0.5,1,2",
                     "--output-scales", "1", "--workers", workers, "--no-progress",
                     "--output-json", str(out)]) == 0
        grids.append(json.loads(out.read_text()))
    assert [g["slo_scale"] for g in grids[1]] == [0.5, 1, 2]
    assert grids[0] == grids[1]
    assert any(g["colocated_per_gpu"] > 0 for g in grids[0])  # something was planned
