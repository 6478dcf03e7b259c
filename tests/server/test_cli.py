"""``pdserve serve`` flags, config building, and a serve/shutdown cycle with the fake runtime."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import types
from pathlib import Path

import httpx
import pytest

from pdserve import flags
from pdserve.config import ClusterConfig, EngineConfig, Link
from pdserve.server import cli
from tests.server.conftest import _free_port
from tests.server.fakes import FakeRuntime

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "max_position_embeddings": 256}


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_engine_flags_are_generated_from_kwargs() -> None:
    parser = argparse.ArgumentParser()
    flags.add_engine_flags(parser, exclude=())
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(EngineConfig.KWARGS)
    args = parser.parse_args(["--block-size", "8", "--no-enable-prefix-caching", "--dtype",
                              "bfloat16", "--gpu-memory-utilization", "0.5", "--role", "prefill",
                              "--enable-chunked-prefill"])
    assert flags.engine_kwargs_from_args(args) == {
        "block_size": 8, "enable_prefix_caching": False, "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5, "role": "prefill", "enable_chunked_prefill": True}
    assert flags.engine_kwargs_from_args(parser.parse_args([])) == {}
    for bad in (["--role", "nonsense"], ["--block-size", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    # every flag says what it does and its default
    for a in parser._actions:
        if a.dest != "help":
            assert a.help and "default" in a.help, a.dest


def test_config_from_args(model_dir: str) -> None:
    args = parse("--model", model_dir, "--strategy", "disaggregated", "--num-prefill", "2",
                 "--num-decode", "3", "--prefill-token-target", "512", "--backend", "inproc",
                 "--kv-link", "25:0.5", "--max-waiting-requests",
                 "7", "--decode-router", "round_robin", "--max-model-len", "128",
                 "--num-kv-blocks", "40", "--no-enable-chunked-prefill", "-tp", "2",
                 "--decode-tp", "1")
    cfg = cli.config_from_args(args)
    pre, dec = cfg.role("prefill"), cfg.role("decode")
    assert (cfg.strategy, pre.count, dec.count, pre.engine["prefill_token_target"]) == \
        ("disaggregated", 2, 3, 512)
    assert (pre.tp, dec.tp, cfg.num_gpus) == (2, 1, 7)
    assert (cfg.backend, cfg.kv_link) == ("inproc", Link(25.0, 0.0005))
    assert (cfg.max_waiting_requests, cfg.decode_router, cfg.prefill_router) == \
        (7, "round_robin", "shortest_queue")
    specs = cfg.instance_specs(256)
    assert [s.instance_id for s in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1",
                                              "decode-2"]
    eng = specs[-1].engine
    assert eng.model == model_dir and eng.cache.num_kv_blocks == 40
    assert eng.scheduler.max_model_len == 128 and eng.scheduler.role == "decode"
    assert eng.scheduler.enable_chunked_prefill is False
    assert specs[0].engine.scheduler.prefill_token_target == 512
    default = cli.config_from_args(parse("--model", model_dir))
    assert default.backend == "ray" and default.strategy == "colocated"
    assert default.instance_specs(256)[0].engine.scheduler.max_model_len == 256


def test_config_file_and_flags_override_it(model_dir: str, tmp_path: Path) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text(f"""
model: {model_dir}
engine: {{max_model_len: 64, enable_prefix_caching: false}}
roles:
  - {{role: prefill, count: 1, tp: 2, engine: {{prefill_token_target: 256}}}}
  - {{role: decode, count: 2}}
decode_router: round_robin
simulation: {{profile: ignored-when-live}}
""")
    cfg = cli.config_from_args(parse("--config", str(spec), "--num-decode", "3",
                                     "--max-model-len", "100"))
    assert cfg.role("decode").count == 3 and cfg.role("prefill").tp == 2
    assert cfg.decode_router == "round_robin"
    eng = cfg.instance_specs(256)[0].engine
    assert eng.scheduler.max_model_len == 100 and eng.cache.enable_prefix_caching is False
    assert eng.scheduler.prefill_token_target == 256
    # the spec round-trips through its file form
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg


OLD_STYLE = """
model: m
strategy: partial
num_instances: 4
slo_ttft: 1.5
macro_instance_size: 2
mitosis: true
mitosis_lower: 2
mitosis_upper: 3
mitosis_interval: 5
"""
OLD_STYLE_TETRI = """
model: m
strategy: disaggregated
length_predictor: oracle
predictor_granularity: 100
predictor_accuracy: 0.75
"""
NESTED = """
model: m
strategy: partial
num_instances: 4
macro: {slo_ttft: 1.5, size: 2, mitosis: true, mitosis_lower: 2, mitosis_upper: 3,
        mitosis_interval: 5}
"""
NESTED_TETRI = """
model: m
strategy: disaggregated
predictor: {name: oracle, granularity: 100, accuracy: 0.75}
"""


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_old_flat_deployment_files_load_as_the_nested_form(tmp_path: Path, suffix: str) -> None:
    import yaml

    def load(text: str, name: str) -> ClusterConfig:
        path = tmp_path / (name + suffix)
        data = yaml.safe_load(text)
        path.write_text(json.dumps(data) if suffix == ".json" else text)
        return flags.deployment_from_args({"config": str(path)})

    old, nested = load(OLD_STYLE, "old"), load(NESTED, "nested")
    assert old == nested
    assert (nested.macro.slo_ttft, nested.macro.slo_tpot, nested.macro.size) == (1.5, 0.1, 2)
    assert (nested.macro.mitosis, nested.macro.mitosis_upper, nested.macro.mitosis_interval) \
        == (True, 3, 5)
    old_t, tetri = load(OLD_STYLE_TETRI, "old_t"), load(NESTED_TETRI, "tetri")
    assert old_t == tetri
    assert (tetri.predictor.name, tetri.predictor.granularity, tetri.predictor.accuracy,
            tetri.predictor.data) == ("oracle", 100, 0.75, None)
    assert nested.router_options()["macro_instance_size"] == 2
    # the file form is the nested one, and it reads back
    assert nested.to_dict()["macro"]["size"] == 2 and "macro_instance_size" not in \
        nested.to_dict()
    assert ClusterConfig.from_dict(nested.to_dict()) == nested


def test_flat_flags_override_a_nested_file(model_dir: str, tmp_path: Path) -> None:
    spec = tmp_path / "d.yaml"
    spec.write_text(NESTED.replace("model: m", f"model: {model_dir}"))
    cfg = cli.config_from_args(parse("--config", str(spec), "--macro-instance-size", "4",
                                     "--no-mitosis"))
    assert (cfg.macro.size, cfg.macro.mitosis, cfg.macro.slo_ttft) == (4, False, 1.5)
    spec.write_text(NESTED_TETRI.replace("model: m", f"model: {model_dir}"))
    cfg = cli.config_from_args(parse("--config", str(spec), "--predictor-granularity", "50"))
    assert (cfg.predictor.name, cfg.predictor.granularity) == ("oracle", 50)


@pytest.mark.parametrize("spec, message", [
    ({"macro": {"sise": 2}}, r"macro: unknown setting\(s\) \['sise'\]"),
    ({"predictor": "oracle"}, "predictor must be a mapping"),
    ({"macro": {"size": 0}}, "macro_instance_size must be an integer >= 1"),
])
def test_bad_nested_settings_name_the_value(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict({"model": "m", **spec})


@pytest.mark.parametrize(("argv", "message"), [
    # each once ran a colocated instance with nothing said (prefill TP2 served unsharded)
    (("--prefill-tp", "2"), "prefill_tp sets prefill instances; this deployment is colocated"),
    (("--num-decode", "2"), "num_decode sets decode instances; this deployment is colocated"),
    (("--prefill-token-target", "512"), "prefill_token_target sets prefill instances"),
    (("--strategy", "disaggregated", "--num-instances", "4"),
     "num_instances counts colocated or temporal instances; this deployment is disaggregated"),
    (("--decode-router", "round_robin"), "decode_router 'round_robin' routes to decode"),
    (("--flip", "idle:60"), "flip 'idle:60' flips prefill and decode instances"),
    (("--strategy", "partial", "--length-predictor", "oracle"),
     "length_predictor 'oracle' predicts for a disaggregated deployment's decode routing "
     "(TetriInfer); this one is partial"),
    (("--macro-instance-size", "2", "--mitosis"),
     "macro_instance_size, mitosis: macro instances' settings (EcoServe), for strategy partial; "
     "this deployment is colocated"),
    # settings of a part that is off
    (("--strategy", "partial", "--mitosis-lower", "1", "--mitosis-upper", "1"),
     "mitosis_lower, mitosis_upper: settings of mitosis scaling, which is off"),
    (("--strategy", "disaggregated", "--predictor-granularity", "50"),
     "predictor_granularity buckets a length predictor's output; length_predictor is 'none'"),
    (("--strategy", "disaggregated", "--length-predictor", "oracle", "--predictor-data",
      "sharegpt"), "predictor_data trains a length predictor; length_predictor 'oracle'"),
    (("--strategy", "disaggregated", "--length-predictor", "classifier", "--predictor-data",
      "m.npz", "--predictor-accuracy", "0.5"),
     "predictor_accuracy sets the oracle's accuracy; length_predictor is 'classifier'"),
])
def test_a_setting_the_deployment_has_no_use_for_is_refused(
        model_dir: str, argv: tuple[str, ...], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", model_dir, *argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve serve: error: ") and message in err, err


def test_the_slos_are_not_only_macro_settings() -> None:
    # --slo-ttft/--slo-tpot also judge simulate's and bench's runs, of any strategy
    cfg = ClusterConfig.from_dict({"model": "m", "slo_ttft": 1.0, "slo_tpot": 0.2})
    assert cfg.strategy == "colocated" and cfg.macro.slo_ttft == 1.0


def test_demo_uses_the_tiny_model(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pdserve.model.tiny")
    fake.default_model_dir = lambda: model_dir  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pdserve.model.tiny", fake)
    assert cli.config_from_args(parse("--demo")).model == model_dir


@pytest.mark.parametrize(("argv", "message"), [
    ((), "give --model"),
    (("--demo", "--model", "x"), "either --model or --demo"),
    (("--model", "/nonexistent/dir"), "/nonexistent/dir"),
    (("--max-model-len", "1000"), "exceeds the model's max_position_embeddings"),
    (("--config", "/nonexistent/d.yaml"), "/nonexistent/d.yaml"),
    (("--kv-link", "-1"), "bandwidth_gb_per_s must be > 0"),
])
def test_bad_values_exit_2(model_dir: str, capsys: pytest.CaptureFixture[str],
                           argv: tuple[str, ...], message: str) -> None:
    if argv and argv[0].startswith("--") and argv[0] not in ("--demo", "--model"):
        argv = ("--model", model_dir, *argv)
    try:
        args = parse(*argv)
    except SystemExit as e:  # rejected by the flag's type: one line, exit 2
        assert e.code == 2
    else:
        assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("argv", "message"), [
    (("--num-instances", "0"), "'0'"),
    (("--block-size", "0"), "'0'"),
    (("--strategy", "hybrid"), "'hybrid'"),
])
def test_bad_flag_values_are_refused_by_the_parser(argv: tuple[str, ...], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


async def test_serve_and_shutdown(model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    runtime = FakeRuntime()

    async def build_runtime(config: object) -> FakeRuntime:
        await runtime.start()
        return runtime

    monkeypatch.setattr(cli, "build_runtime", build_runtime)  # the name serve() calls
    config = cli.config_from_args(parse("--model", model_dir, "--backend", "inproc"))
    port = _free_port()
    task = asyncio.create_task(cli.serve(config, port=port, served_model_name="tiny",
                                         api_key="k", log_level="warning"))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as c:
        for _ in range(500):
            if "serving 'tiny'" in capsys.readouterr().out:
                break
            assert not task.done(), task
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                         json={"model": "tiny", "prompt": "abc", "max_tokens": 2})
        assert r.json()["choices"][0]["text"] == "de"
    assert runtime.started
    os.kill(os.getpid(), signal.SIGINT)  # handled by serve(): graceful shutdown
    await asyncio.wait_for(task, timeout=10)
    assert not runtime.started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize(("text", "message"), [
    ("engine: {block_size: x}", "block_size must be an integer, got 'x'"),
    ("engine: {enable_prefix_caching: maybe}", "enable_prefix_caching must be true or false"),
    ("roles: [{role: decode}]", "roles must be [colocated], [prefill, decode] or [temporal]"),
    ("roles: [{role: colocated, count: two}]", "count must be an integer >= 1, got 'two'"),
    ("colour: blue", "unknown deployment setting(s) ['colour']"),
    ("kv_link: {bandwidth_gb_per_s: -3}", "bandwidth_gb_per_s must be > 0"),
    ("model: [", "is not valid YAML"),
])
def test_bad_spec_files_name_the_value(model_dir: str, tmp_path: Path, text: str, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(text + "\n")
    args = parse("--model", model_dir, "--config", str(spec))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve serve: error: ") and message in err, err
