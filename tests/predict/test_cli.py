"""``pdserve predictor train | eval`` and the pair log the server writes (TetriInfer §3.3.2):
trained and evaluated on a small fixed data set whose answer lengths only the prompt's tokens
tell apart, so the classifier must beat both baselines; bad input exits 2 with one line."""

import json

import numpy as np
import pytest

from pdserve.cli import main as pdserve_main
from pdserve.predict import make_predictor
from pdserve.predict.data import PairLog, load_pairs
from tests.predict.test_predict import _token_signal_pairs


@pytest.fixture
def pairs_file(tmp_path):
    pairs = _token_signal_pairs(200)
    log = PairLog(tmp_path / "logs" / "pairs.jsonl")  # the parent is created
    for p, n in zip(pairs.prompts, pairs.output_lens):
        log.write(p, int(n))
    log.close()
    return tmp_path / "logs" / "pairs.jsonl", pairs


def test_pair_log_round_trip_and_append(tmp_path):
    f = tmp_path / "p.jsonl"
    log = PairLog(f)
    log.write([5, 6, 7], 12)
    log.close()
    log = PairLog(f)  # a restarted server appends
    log.write([8], 0)
    log.close()
    assert [json.loads(line) for line in f.read_text().splitlines()] == [
        {"prompt_token_ids": [5, 6, 7], "output_len": 12},
        {"prompt_token_ids": [8], "output_len": 0}]
    p = load_pairs(str(f))
    assert p.prompts == [[5, 6, 7], [8]] and list(p.output_lens) == [12, 0]
    with pytest.raises(ValueError, match="is a directory"):
        PairLog(tmp_path)


def test_train_beats_the_baselines_saves_and_eval_reloads(pairs_file, tmp_path, capsys):
    path, pairs = pairs_file
    model = tmp_path / "m.npz"
    assert pdserve_main(["predictor", "train", "--data", str(path), "--granularity", "200",
                         "--output", str(model)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| ") and "granularity" not in line}
    assert set(rows) == {"majority", "prompt-length", "classifier"}
    # 40 held out (seed 0); long answers (~500 tokens) are bucket 2, short ones bucket 0
    assert rows["classifier"][3].strip() == "100.0%"
    assert "0: 100%" in rows["classifier"][5] and "2: 100%" in rows["classifier"][5]
    for base in ("majority", "prompt-length"):  # one prompt length: a single guess
        assert float(rows[base][3].strip().rstrip("%")) < 60
    clf = make_predictor("classifier", data=str(model))
    assert clf.granularity == 200
    want = np.where(pairs.output_lens >= 400, 2, 0)
    got = [clf.predict(p, 1).bucket for p in pairs.prompts]
    assert got == want.tolist()
    assert pdserve_main(["predictor", "eval", "--data", str(path), "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert "200 pairs" in out and "| classifier | 200 | 100.0% | 100.0% |" in out


@pytest.mark.parametrize("args, bad", [
    (["train", "--granularity", "0", "--output", "m.npz"], "'0'"),
    (["train", "--output", "m.txt"], "m.txt"),
    (["train", "--output", "m.npz", "--eval-share", "1"], "'1'"),
    (["train", "--output", "m.npz", "--data", "missing.jsonl"], "missing.jsonl"),
    (["eval", "--model", "missing.npz"], "missing.npz"),
])
def test_bad_input_exits_2_with_one_line(args, bad, pairs_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path, _ = pairs_file
    if "--data" not in args:
        args = [*args, "--data", str(path)]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(pdserve_main(["predictor", *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and bad in err, err



@pytest.fixture
def served(monkeypatch):
    """``pdserve serve``'s server loop replaced by one that records its arguments."""
    import pdserve.server.cli as serve_cli

    calls = []

    async def fake_serve(config, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(args)

    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    return calls


def test_serve_hands_the_pair_log_to_the_server_and_closes_it(tmp_path, served):
    f = tmp_path / "pairs.jsonl"
    assert pdserve_main(["serve", "--demo", "--backend", "inproc",
                         "--log-length-pairs", str(f)]) == 0
    [args] = served
    log = args[-1]
    assert isinstance(log, PairLog) and log.path == f and log.closed
    assert pdserve_main(["serve", "--demo", "--backend", "inproc"]) == 0
    assert served[1][-1] is None  # off by default


def test_serve_refuses_an_unwritable_pair_log_before_loading(tmp_path, capsys, served):
    """``pdserve serve --log-length-pairs`` opens its file before any instance starts."""
    with pytest.raises(SystemExit) as e:
        raise SystemExit(pdserve_main(["serve", "--demo", "--backend", "inproc",
                                       "--log-length-pairs", str(tmp_path)]))
    assert e.value.code == 2 and served == []
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"length-pair log {str(tmp_path)!r} is a directory"), err
