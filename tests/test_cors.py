"""CORS (--allowed-origins and friends): a web page on another origin may call the API as
vLLM and llama.cpp allow by default, its preflight needs no API key, and refusals (401, 413,
503) carry the headers too, so the page reads the error instead of a network failure."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.api import build_app
from server.engine_slot import EngineSlot
from server.settings import ServerSettings, flag_list

PAGE = "http://ui.example:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def app_client(**settings) -> TestClient:
    s = ServerSettings(**settings)
    return TestClient(build_app(EngineSlot("m"), lambda: None, served_model_name="m",
                                api_key=s.api_key, max_request_bytes=1000, cors=s.cors()))


def test_any_origin_by_default_and_the_preflight_needs_no_key():
    c = app_client(api_key="secret")
    pre = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    assert "POST" in pre.headers["access-control-allow-methods"]
    for r in (c.get("/v1/models", headers={"Origin": PAGE}),          # 401: no key
              c.post("/v1/chat/completions", content=b"x" * 5000,     # 413: over the limit
                     headers={"Origin": PAGE, "Authorization": "Bearer secret",
                              "content-type": "application/json"}),
              c.get("/health", headers={"Origin": PAGE})):            # 503: loading
        assert r.status_code in (401, 413, 503)
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.json()["error"]["message"]
    assert "access-control-allow-origin" not in c.get("/health").headers   # not a browser


def test_named_origins_alone():
    c = app_client(allowed_origins=f'["{PAGE}"]', allowed_methods="GET,POST",
                   allow_credentials=True)
    ok = c.options("/v1/completions", headers=PREFLIGHT)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    assert ok.headers["access-control-allow-credentials"] == "true"
    other = {**PREFLIGHT, "Origin": "http://evil.example"}
    assert c.options("/v1/completions", headers=other).status_code == 400
    r = c.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    put = {**PREFLIGHT, "Access-Control-Request-Method": "PUT"}
    assert c.options("/v1/completions", headers=put).status_code == 400
    none = app_client(allowed_origins="")
    assert "access-control-allow-origin" not in none.get(
        "/health", headers={"Origin": PAGE}).headers


def test_list_flags_and_their_errors():
    assert flag_list('["a", "b"]', "--x") == ["a", "b"]
    assert flag_list(" a, b ,,", "--x") == ["a", "b"]
    assert flag_list("", "--x") == []
    with pytest.raises(ValueError, match="--x"):
        flag_list("[a", "--x")
    with pytest.raises(ValueError, match="strings"):
        flag_list("[1]", "--x")
    with pytest.raises(ValueError, match="allow-credentials"):
        ServerSettings(allow_credentials=True)
