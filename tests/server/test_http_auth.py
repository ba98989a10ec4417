"""API keys guard every HTTP route under /v1 (and /metrics), against the real server.

The routes come from the app itself, so a route added later without the check fails here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.routing import Route

from duplex_server.auth import guards_http_path
from tests.server.harness import running_server, write_config

KEY = "sk-http-0123456789"
OTHER = "sk-http-second"


def _http_routes(apps: list[object]) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route of the running app, path parameters filled in."""
    out: list[tuple[str, str]] = []
    for route in apps[0].routes:  # type: ignore[attr-defined]
        if not isinstance(route, Route) or route.methods is None:
            continue
        path = route.path.replace("{call_id}", "call_x")
        for method in sorted(route.methods - {"HEAD"}):
            out.append((method, path))
    return out


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[object]]]:
    path = write_config(tmp_path_factory.mktemp("keyed"), server={"api_keys": [KEY, OTHER]})
    apps: list[object] = []
    with running_server(path, apps=apps) as addr:
        yield addr, apps


def test_every_v1_route_and_metrics_refuse_a_missing_or_wrong_key(
    keyed: tuple[str, list[object]],
) -> None:
    addr, apps = keyed
    routes = _http_routes(apps)
    guarded = [(m, p) for m, p in routes if guards_http_path(p, "keyed")]
    paths = {p for _, p in guarded}
    # the batch routes, the model list, WebRTC and /metrics are all among them
    for expected in (
        "/v1/models",
        "/v1/audio/speech",
        "/v1/chat/completions",
        "/v1/audio/transcriptions",
        "/v1/realtime/calls",
        "/metrics",
    ):
        assert expected in paths

    async def run() -> None:
        async with httpx.AsyncClient(base_url=f"http://{addr}") as http:
            for method, path in guarded:
                for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
                    r = await http.request(method, path, headers=headers, content=b"{}")
                    assert r.status_code == 401, (method, path, headers)
                    err = r.json()["error"]
                    assert err["type"] == "invalid_request_error"
                    assert err["code"] == "invalid_api_key"
                    assert err["param"] is None and "API key" in err["message"]
                    assert r.headers["www-authenticate"].startswith("Bearer")
                for key in (KEY, OTHER):  # either key gets past the check
                    r = await http.request(
                        method, path, headers={"Authorization": f"Bearer {key}"}, content=b"{}"
                    )
                    assert r.status_code != 401, (method, path)

    asyncio.run(run())


def test_a_keyed_request_is_served(keyed: tuple[str, list[object]]) -> None:
    addr, _ = keyed
    key = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=f"http://{addr}") as http:
        assert http.get("/health").status_code == 200  # stays open
        models = http.get("/v1/models", headers=key)
        assert models.status_code == 200 and models.json()["object"] == "list"
        chat = http.post(
            "/v1/chat/completions",
            headers=key,
            json={"model": "duplex", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        metrics = http.get("/metrics", headers=key)
        assert metrics.status_code == 200 and "duplex_" in metrics.text
        page = http.get("/")
        assert page.status_code == 200  # the browser page itself holds no secret


def test_metrics_open_when_configured_and_origin_refused_on_http(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        server={"api_keys": [KEY], "metrics_access": "open", "allowed_origins": ["http://ok"]},
    )
    with running_server(path) as addr, httpx.Client(base_url=f"http://{addr}") as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 401
        key = {"Authorization": f"Bearer {KEY}"}
        r = http.get("/v1/models", headers={**key, "Origin": "http://evil"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert http.get("/v1/models", headers={**key, "Origin": "http://ok"}).status_code == 200


def test_no_keys_configured_leaves_routes_open(tmp_path: Path) -> None:
    with running_server(write_config(tmp_path)) as addr:
        with httpx.Client(base_url=f"http://{addr}") as http:
            assert http.get("/v1/models").status_code == 200
            assert http.get("/metrics").status_code == 200


def test_a_bad_metrics_access_value_fails_start_up(tmp_path: Path) -> None:
    from duplex_contract.errors import ConfigError
    from duplex_server.config import load_app_config

    path = write_config(tmp_path, server={"metrics_access": "public"})
    with pytest.raises(ConfigError, match="metrics_access"):
        load_app_config(path)
