"""Log files never take the service down: ``--step-log`` and ``--log-length-pairs`` paths are
checked at start (one line naming the path, exit 2); a write that fails at run time (a full
disk: ``/dev/full``) is counted in ``/metrics`` and never reaches a response; a log file rotated
away is reopened at its path."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pdserve.predict.data import PairLog
from pdserve.server import build_app
from tests.server.fakes import FakeRuntime
from tests.server.test_cli import model_dir, parse  # noqa: F401 - a fixture

__all__ = ["model_dir"]


def _bad_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    (tmp_path / "file").write_text("")
    return {"dir": (str(tmp_path), "is a directory"),
            "full": ("/dev/full", "not a regular file"),
            "under_file": (str(tmp_path / "file" / "x.jsonl"), "ot a directory"),
            # os.access calls /proc writable for root; statvfs says 0 bytes free there
            "proc": ("/proc/x.jsonl", "the directory '/proc' is not writable")}


@pytest.mark.parametrize("flag", ["--step-log", "--log-length-pairs"])
@pytest.mark.parametrize("case", ["dir", "full", "under_file", "proc"])
def test_unusable_log_paths_exit_2_before_loading(flag: str, case: str, model_dir: str,  # noqa: F811
                                                  tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path, why = _bad_paths(tmp_path)[case]
    args = parse("--model", model_dir, "--backend", "inproc", flag, path)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and repr(path) in err and why in err, err


def _pairs_metric(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("pdserve:log_write_errors_total{") and 'log="length_pairs"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no log_write_errors_total series in\n{text}")


async def test_a_full_disk_under_the_pair_log_is_counted_not_a_500(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    log = PairLog(path)
    app = build_app(FakeRuntime(), "m", pair_log=log)
    body = {"prompt": "abc", "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                 base_url="http://t") as c:
        assert (await c.post("/v1/completions", json=body)).status_code == 200
        path.unlink()
        path.symlink_to("/dev/full")  # from now on every write gets ENOSPC
        for _ in range(3):
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert _pairs_metric((await c.get("/metrics")).text) == 3
        path.unlink()  # rotated away / space again: reopened at the path
        assert (await c.post("/v1/completions", json=body)).status_code == 200
        assert _pairs_metric((await c.get("/metrics")).text) == 3
    log.close()
    [line] = path.read_text().splitlines()
    assert json.loads(line)["output_len"] == 2


def test_a_renamed_pair_log_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    log = PairLog(path)
    assert log.write([1, 2], 3)
    path.rename(tmp_path / "pairs.1.jsonl")
    assert log.write([4], 5)
    log.close()
    assert [json.loads(x)["output_len"] for x in path.read_text().splitlines()] == [5]
    assert log.count == 2 and log.errors == 0
