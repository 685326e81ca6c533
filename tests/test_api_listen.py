"""Where and how the server listens: HTTPS (--ssl-keyfile/--ssl-certfile, a self-signed
certificate made with openssl), a path prefix behind a reverse proxy (--root-path), a Unix
socket (--uds); the open routes vLLM has besides /health (/ping, /version); a log line per
request (--enable-log-requests); a client's X-Request-Id."""
from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from server.settings import ServerSettings
from tests.server_helpers import MODEL, STARTUP_TIMEOUT_S, running_server

pytestmark = pytest.mark.slow


def ready(get, url: str) -> httpx.Response:
    deadline = time.monotonic() + min(STARTUP_TIMEOUT_S, 300)
    while True:
        try:
            r = get(url)
            if r.status_code == 200:
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


def test_https_behind_a_path_prefix(certificate):
    key, cert = certificate
    with running_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                        "--root-path", "/strata", wait=False) as s:
        base = f"https://127.0.0.1:{s.port}"
        tls = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=tls, timeout=30) as https:
            ready(https.get, base + "/health")         # the proxy strips its prefix
            assert https.get(base + "/openapi.json").json()["servers"] == [{"url": "/strata"}]
            with pytest.raises(httpx.TransportError):  # no plain HTTP
                httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
            client = openai.OpenAI(base_url=base + "/v1", api_key="none",
                                   http_client=httpx.Client(verify=tls), max_retries=0)
            r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": "Hi"}])
            assert r.usage.completion_tokens == 2


def test_a_unix_socket_and_the_open_routes(tmp_path):
    sock = tmp_path / "strata.sock"
    with running_server("--uds", str(sock), "--enable-log-requests", wait=False) as s:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30) as c:
            ready(c.get, "http://strata/health")
            r = c.post("http://strata/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            assert r.status_code == 200
            line = f"{r.json()['id']}-0: 1 prompt tokens (0 cached), 3 output tokens (length)"
            assert line in s.log_tail(20000)                # --enable-log-requests
            # a client's X-Request-Id: in the answer's id and headers, twice at once too
            trace = {"X-Request-Id": "trace-42"}
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                    "stream": True}
            with c.stream("POST", "http://strata/v1/chat/completions", json=body,
                          headers=trace) as first:
                assert first.headers["x-request-id"] == "trace-42"
                again = c.post("http://strata/v1/chat/completions", headers=trace,
                               json={**body, "stream": False, "max_tokens": 2})
                assert again.status_code == 200 and again.json()["id"] == "chatcmpl-trace-42"
                assert again.headers["x-request-id"] == "trace-42"
                assert '"id":"chatcmpl-trace-42"' in "".join(first.iter_lines())
            # engine ids: a nonce more (the two at once were two engine requests)
            assert len(set(re.findall(r"chatcmpl-trace-42-[0-9a-f]{8}-0: ",
                                      s.log_tail(20000)))) == 2
            assert c.get("http://strata/ping").status_code == 200
            assert c.post("http://strata/ping").status_code == 200
            version = c.get("http://strata/version").json()["version"]
            assert version and version != "unknown"
            assert c.get("http://strata/v1/models").json()["data"][0]["id"] == MODEL


def test_tls_files_are_checked_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        ServerSettings(ssl_keyfile=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        ServerSettings(ssl_keyfile=str(tmp_path / "k"), ssl_certfile=str(tmp_path / "c"))
    assert ServerSettings(uds="/tmp/s").listen() == {"uds": "/tmp/s", "root_path": ""}
