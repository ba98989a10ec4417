"""Unknown routes and methods under /v1 answer in OpenAI's error shape (JSON, naming the
route; a wrong method lists the allowed ones); outside /v1 the page's files stay plain."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.harness import running_server, write_config


def test_unknown_v1_routes_and_methods_are_openai_shaped(tmp_path: Path) -> None:
    with running_server(write_config(tmp_path)) as addr:
        base = f"http://{addr}"
        missing = httpx.post(f"{base}/v1/audio/translations", json={})
        assert missing.status_code == 404
        assert missing.json() == {
            "error": {
                "message": "Invalid URL (POST /v1/audio/translations)",
                "type": "invalid_request_error",
                "param": None,
                "code": "unknown_url",
            }
        }
        wrong = httpx.get(f"{base}/v1/audio/speech")
        assert wrong.status_code == 405
        err = wrong.json()["error"]
        assert err["code"] == "method_not_allowed" and "POST" in err["message"]
        assert wrong.headers["allow"] == "POST"
        assert httpx.get(f"{base}/v1").status_code == 404
        assert httpx.get(f"{base}/v1").json()["error"]["code"] == "unknown_url"
        page = httpx.get(f"{base}/no-such-file.js")
        assert page.status_code == 404 and page.headers["content-type"].startswith("text/plain")
