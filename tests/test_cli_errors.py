"""Bad command-line values are one line and exit 2, early: the serve port before any model
loads, argparse errors of every subcommand without a usage block, multi-line library messages
folded, warnings as one ``pdserve: warning:`` line without source lines."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.flags import output_dir, output_file

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(("port", "says"), [("99999", "outside 1-65535"),
                                            ("0", "outside 1-65535"),
                                            ("-1", "outside 1-65535")])
def test_port_out_of_range(capsys: pytest.CaptureFixture[str], port: str, says: str) -> None:
    # the model does not exist either: the port is checked first, before anything loads
    assert main(["serve", "--model", "/nonexistent/model", "--port", port]) == 2
    line = one_error_line(capsys)
    assert says in line and f"--port {port}" in line


def test_port_in_use_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent/model", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} is already in use" in one_error_line(capsys)


def test_host_that_does_not_resolve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--demo", "--host", "no-such-host.invalid"]) == 2
    assert "does not resolve" in one_error_line(capsys)


@pytest.mark.parametrize("argv", [
    ["bench", "--target", "sim", "--rate", "0"],
    ["goodput", "--target", "sim", "--precision", "x"],
    ["predictor", "train", "--granularity", "x"],
    ["calibrate", "--hardware"],
    ["serve", "--port", "eighty"],
])
def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert one_error_line(capsys).startswith(f"pdserve {argv[0]}")


def test_library_messages_are_folded_into_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")  # PyYAML's message spans three lines
    assert main(["simulate", "--config", str(bad)]) == 2
    assert "not valid YAML" in one_error_line(capsys)


def test_missing_calibration_source_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--hardware", "A100-80GB", "--profile", "/nonexistent.json",
                 "--model", "opt-13b"]) == 2
    assert "/nonexistent.json" in one_error_line(capsys)


def test_warnings_are_one_plain_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_TRACES=str(tmp_path / "none"))
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "simulate", "--model", "opt-13b", "--hardware",
         "A100-80GB", "--workload", "chatbot", "--num-requests", "3", "--rate", "1",
         "--no-progress"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    notes = [ln for ln in lines if "bundled" in ln]
    assert notes and all(ln.startswith("pdserve: warning: trace folder not found") for ln in notes)
    assert "UserWarning" not in r.stderr and "load_trace(" not in r.stderr, r.stderr


@pytest.mark.parametrize(("argv", "says"), [
    (["simulate", "--rate", "1", "--output-json", "/proc/no-such/x.json"],
     "--output-json: cannot write '/proc/no-such/x.json'"),
    (["bench", "--target", "sim", "--rate", "1", "--plot", "/etc/hostname"],
     "--plot: expected a folder, got '/etc/hostname'"),
    (["profile", "--model", "m", "--out", "/proc/no-such/p.json"],
     "--out: cannot write '/proc/no-such/p.json'"),
    # /proc exists and os.access calls it writable for root, but no file can be made in it
    (["plan", "--rate", "1", "--out", "/proc/plan.yaml"],
     "--out: cannot write '/proc/plan.yaml': '/proc' is not a writable folder"),
    (["predictor", "train", "--data", "sharegpt", "--output", "/proc/m.npz"],
     "--output: cannot write '/proc/m.npz'"),
])
def test_an_output_that_cannot_be_written_fails_before_the_work(
        capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert says in one_error_line(capsys)


@pytest.mark.parametrize("argv", [
    ["plan", "--rate", "1", "--seed", "-1"],
    ["advise", "--seed", "-1"],
    ["simulate", "--rate", "1", "--seed", "-1"],
    ["bench", "--target", "sim", "--rate", "1", "--seed", "-1"],
    ["demo", "--seed", "-1"],
    ["predictor", "train", "--data", "sharegpt", "--output", "m.npz", "--seed", "-1"],
])
def test_a_negative_workload_seed_is_named_before_the_work(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # numpy refuses it late, as "expected non-negative integer" without the flag
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "argument --seed: must be an integer >= 0, got '-1'" in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--hidden-size", "--num-layers", "--num-heads",
                                  "--intermediate-size", "--max-position-embeddings"])
def test_a_tiny_model_size_of_zero_is_refused(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path, flag: str) -> None:
    # 0 once fell back to the default size silently (``hidden_size or 64``)
    with pytest.raises(SystemExit) as e:
        main(["make-tiny-model", str(tmp_path / "m"), flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be an integer >= 1, got '0'" in one_error_line(capsys)
    assert not (tmp_path / "m").exists()


def test_an_output_folder_is_made_when_the_flag_is_read(tmp_path: Path) -> None:
    assert output_file(str(tmp_path / "a" / "b.json")) == str(tmp_path / "a" / "b.json")
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b.json").exists()
    assert output_dir(str(tmp_path / "c" / "d")) and (tmp_path / "c" / "d").is_dir()


@pytest.mark.parametrize(("text", "says"), [("root:x:0:0\n", "is not a JSON profile"),
                                            ("[1, 2]", "a JSON object was expected")])
def test_a_profile_that_is_not_one_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            text: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["simulate", "--rate", "1", "--num-requests", "5", "--profile", str(bad)]) == 2
    line = one_error_line(capsys)
    assert repr(str(bad)) in line and says in line


def test_a_kv_pool_that_cannot_hold_one_request_is_refused_at_start(
        capsys: pytest.CaptureFixture[str]) -> None:
    # it served before, answering every request longer than 32 tokens with a 503
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--demo", "--backend", "inproc", "--num-kv-blocks", "2",
                 "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "pdserve serve: error: instance colocated-0's KV pool holds 2 blocks of 16 tokens (32 "
        "tokens), fewer than one request of max_model_len=1024 needs (64 blocks): raise "
        "num_kv_blocks (or gpu_memory_utilization, cpu_kv_gib), or set max_model_len <= 32")
    assert main(["serve", "--demo", "--backend", "inproc", "--num-kv-blocks", "2",
                 "--max-model-len", "33", "--port", str(port), "--pipeline-parallel-size",
                 "1"]) == 2
    assert "needs (3 blocks)" in capsys.readouterr().err


def test_odd_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text("model: opt-13b\nsimulation: 5\n")  # once "'int' object is not iterable"
    assert main(["simulate", "--config", str(spec), "--rate", "1", "--num-requests", "3"]) == 2
    assert "simulation must be a mapping (profile, hardware, ...), got 5" in \
        capsys.readouterr().err
    # scrape a simulation's /metrics: the file was never written, nothing said
    assert main(["bench", "--target", "sim", "--rate", "1", "--num-requests", "3",
                 "--scrape-metrics", str(tmp_path / "m.jsonl")]) == 2
    assert "--scrape-metrics scrapes a live server's /metrics; target 'sim' has none" in \
        capsys.readouterr().err
    assert main(["bench", "--target", "sim", "--rate", "1", "--num-requests", "3",
                 "--scrape-interval", "2"]) == 2  # it was ignored
    assert "--scrape-interval is the period of --scrape-metrics; add --scrape-metrics FILE" in \
        capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_text("not a classifier")  # numpy spoke of pickles and allow_pickle
    assert main(["predictor", "eval", "--data", "sharegpt", "--model", str(bad)]) == 2
    assert f"{str(bad)!r} is not a length classifier saved by `pdserve predictor train`" in \
        capsys.readouterr().err


def test_calibrate_takes_a_profile_by_name_and_checks_its_output_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    # --profile NAME was opened as a path ('No such file or directory'), unlike simulate's
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--hardware", "A100-80GB", "--model", "opt-13b", "--profile",
              "distserve_profiler-a100-80g.distserve", "-o", "/proc/cal.yaml"])
    assert e.value.code == 2
    assert "--output/-o: cannot write '/proc/cal.yaml'" in one_error_line(capsys)


def test_calibrate_resolves_a_profile_name(tmp_path: Path) -> None:
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--hardware", "A100-80GB", "--model", "opt-13b", "--profile",
                 "distserve_profiler-a100-80g.distserve", "-o", str(out)]) == 0
    assert out.is_file()


def test_a_compare_target_needs_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--target", "=sim", "--rate", "1", "--num-requests", "3"]) == 2
    assert "every target needs a name (NAME=URL), got ['']" in one_error_line(capsys)


@pytest.mark.parametrize(("flags", "says"), [
    (["--tp", "2"], "--tp acts with --step-log or --timelines or --metrics-log; give one"),
    (["--quick"], "--quick acts with --measure; give one"),
    (["--splitwise-hardware", "h100-80gb"], "--splitwise-hardware acts with --splitwise"),
])
def test_a_calibrate_flag_without_the_flag_it_acts_with_is_refused(
        capsys: pytest.CaptureFixture[str], flags: list[str], says: str) -> None:
    # each was ignored: a profile-only fit with --tp 2 fitted what it fits without it
    assert main(["calibrate", "--hardware", "A100-80GB", "--model", "opt-13b", "--profile",
                 "distserve_profiler-a100-80g.distserve", *flags]) == 2
    assert says in one_error_line(capsys)


def test_an_aic_backend_without_an_aic_system_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    # simulate priced the analytic roofline and dropped the backend; plan refused it already
    assert main(["simulate", "--rate", "1", "--num-requests", "3", "--aic-backend",
                 "sglang"]) == 2
    assert "aic_backend 'sglang' (--aic-backend) picks the kernel database's backend: give " \
           "aic_system (--aic-system) too" in capsys.readouterr().err
