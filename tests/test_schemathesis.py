"""Schemathesis against the live server's /openapi.json: generated requests for every operation
(valid and invalid), checked for 5xx, undeclared status codes, wrong content types and bodies
that do not match the declared schemas. Bounded (a fixed seed, 15 cases per operation) so it
runs in about a minute; a short context keeps every generation short."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_helpers import running_server

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")
CLI = Path(sys.executable).with_name("schemathesis")


@pytest.mark.skipif(not CLI.exists() and shutil.which("schemathesis") is None,
                    reason="schemathesis is not installed (the test extra)")
def test_generated_requests_get_no_5xx_and_match_the_openapi_schema():
    with running_server("--max-model-len", "128") as server:
        result = subprocess.run(
            [str(CLI if CLI.exists() else shutil.which("schemathesis")), "run",
             f"{server.url}/openapi.json", "--checks", CHECKS, "--phases", "examples,fuzzing",
             "--max-examples", "15", "--seed", "1", "--request-timeout", "60", "--no-shrink"],
            capture_output=True, text=True, timeout=600)
    tail = "\n".join(result.stdout.splitlines()[-40:])
    assert result.returncode == 0, tail
    assert " failed" not in tail.split("SUMMARY")[-1], tail
