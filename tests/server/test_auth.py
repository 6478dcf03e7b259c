"""Auth that covers the surface: with a key every endpoint but ``/health``, ``/ping`` and
``/version`` needs it; ``/admin`` is off unless enabled, capped, and takes its own key when one
is given; any ``Authorization`` header (non-ASCII too) is a 401, not a 500; keys come from a
flag, a file or the environment and are compared as SHA-256 digests in constant time."""

from __future__ import annotations

import hmac
from pathlib import Path

import httpx
import pytest

from pdserve.cluster.serving_api import InstanceStatus, Removal
from pdserve.server import build_app
from pdserve.server import cli as serve_cli
from tests.server.fakes import FakeRuntime
from tests.server.test_cli import model_dir, parse  # noqa: F401 - a fixture

COMPL = "/v1/completions"


class ScalingFake(FakeRuntime):
    """A fake runtime with the ``ScalableRuntime`` methods (instances are names only)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra: list[str] = []

    async def add_instance(self, role: str, instance_id: str | None = None) -> str:
        iid = instance_id or f"{role}-{len(self.extra) + 1}"
        self.extra.append(iid)
        return iid

    async def remove_instance(self, instance_id: str,
                              drain_timeout: float | None = None) -> Removal:
        if instance_id not in self.extra:
            raise ValueError(f"unknown instance {instance_id!r}")
        self.extra.remove(instance_id)
        return Removal(instance_id, "colocated", 0.0, 0.0, None)

    def instance_status(self) -> list[InstanceStatus]:
        return super().instance_status() + [InstanceStatus(i, "colocated", True, None)
                                            for i in self.extra]


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t")


async def test_admin_is_off_unless_enabled() -> None:
    async with _client(build_app(ScalingFake(), "m")) as c:
        r = await c.post("/admin/instances", json={"action": "add", "role": "colocated"})
        assert r.status_code == 404 and "--enable-admin" in r.json()["error"]["message"]
        assert (await c.get("/admin/instances")).status_code == 404
        assert "/admin/instances" not in (await c.get("/openapi.json")).json()["paths"]


async def test_every_endpoint_but_health_ping_version_needs_the_key() -> None:
    app = build_app(ScalingFake(), "m", api_key="k", enable_admin=True)
    ok = {"Authorization": "Bearer k"}
    calls = [("POST", COMPL, {"prompt": "a", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
             ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "ab"}),
             ("POST", "/detokenize", {"tokens": [1, 2]}), ("GET", "/metrics", None),
             ("GET", "/openapi.json", None), ("GET", "/docs", None),
             ("GET", "/admin/instances", None), ("GET", "/nonexistent", None)]
    async with _client(app) as c:
        for method, path, body in calls:
            r = await c.request(method, path, json=body)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
            if path != "/nonexistent":
                assert (await c.request(method, path, json=body, headers=ok)).status_code \
                    == 200, path
        for path in ("/health", "/ping", "/version"):
            assert (await c.get(path)).status_code == 200, path


@pytest.mark.parametrize("path", ["/admin/instances", "/v1/models", "/metrics"])
async def test_a_non_ascii_authorization_header_is_a_401(path: str) -> None:
    app = build_app(ScalingFake(), "m", api_key="k", enable_admin=True)
    async with _client(app) as c:
        for value in ("Bearer k\u00e9".encode("latin-1"), b"\xff\xfe", "Bearer ☃".encode()):
            r = await c.get(path, headers={"Authorization": value})
            assert r.status_code == 401, (value, r.text)


async def test_a_separate_admin_key_and_the_instance_cap() -> None:
    rt = ScalingFake()
    app = build_app(rt, "m", api_key="k", admin_key="adm", max_instances=2)
    user, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}
    add = {"action": "add", "role": "colocated"}
    async with _client(app) as c:
        r = await c.post("/admin/instances", json=add, headers=user)
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
        assert (await c.get("/v1/models", headers=admin)).status_code == 401
        r = await c.post("/admin/instances", json=add, headers=admin)
        assert r.status_code == 200 and len(r.json()["instances"]) == 2, r.text
        r = await c.post("/admin/instances", json=add, headers=admin)  # 3 > 2
        assert r.status_code == 400 and "--max-instances 2" in r.json()["error"]["message"]
        assert rt.extra == ["colocated-1"]
        r = await c.post("/admin/instances", json={"action": "remove",
                                                   "instance_id": "colocated-1"}, headers=admin)
        assert r.status_code == 200 and rt.extra == []


async def test_keys_are_compared_as_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr("pdserve.server.errors.hmac.compare_digest", spy)
    app = build_app(FakeRuntime(), "m", api_key="a-rather-long-key-" * 4)
    async with _client(app) as c:
        for got in ("Bearer x", "Bearer " + "y" * 500):
            assert (await c.get("/v1/models", headers={"Authorization": got})).status_code \
                == 401
    assert seen == [(32, 32), (32, 32)]  # SHA-256 of both sides: no length leaks


def test_keys_come_from_a_flag_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("from-file\nignored\n")
    assert serve_cli.keys_from_args(parse("--api-key", "flag")) == ("flag", None)
    assert serve_cli.keys_from_args(parse("--api-key-file", str(f))) == ("from-file", None)
    monkeypatch.setenv("PDSERVE_API_KEY", "env")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "adm")
    assert serve_cli.keys_from_args(parse()) == ("env", "adm")
    assert serve_cli.keys_from_args(parse("--admin-key-file", str(f))) == ("env", "from-file")


@pytest.mark.parametrize(("argv", "message"), [
    (("--api-key", "x", "--api-key-file", "{f}"), "give one of --api-key and --api-key-file"),
    (("--api-key-file", "{empty}"), "is empty"),
    (("--api-key-file", "{missing}"), "cannot be read"),
    (("--api-key", "sp ace"), "printable ASCII"),
    (("--max-instances", "4"), "--max-instances caps /admin/instances, which is off"),
])
def test_bad_key_settings_exit_2_with_one_line(argv: tuple[str, ...], message: str,
                                               tmp_path: Path, model_dir: str,  # noqa: F811
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    (tmp_path / "f").write_text("k\n")
    (tmp_path / "empty").write_text("\n")
    paths = {"f": tmp_path / "f", "empty": tmp_path / "empty", "missing": tmp_path / "nope"}
    args = parse("--model", model_dir, "--backend", "inproc",
                 *(a.format(**paths) for a in argv))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
