"""schemathesis against our own `/openapi.json`, served with FakeEngine (no weights).

schemathesis generates valid and invalid requests from the document and checks every answer:
no 5xx, status codes, content types and bodies (JSON and SSE events) as the document says,
invalid data rejected, 405 + `Allow` for undeclared methods. Bounded (a few examples per
operation, fixed seed) to stay within CI time; docs/server.md records a longer run against
the real default model. "Schema-valid request rejected" (positive_data_acceptance) is not
checked: some rules span fields (max_tokens vs the context left, token ids vs the vocabulary).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.testing import FakeEngine, LiveServer, build_test_tokenizer

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance,negative_data_rejection,unsupported_method,allow_header_conformance,"
    "missing_required_header"
)


def schemathesis_command() -> list[str]:
    executable = Path(sys.executable).with_name("schemathesis")
    if executable.exists():
        return [str(executable)]
    found = shutil.which("schemathesis")
    if found is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[test]'")
    return [found]


def test_schemathesis_finds_no_server_errors_or_schema_violations(tmp_path):
    engine = FakeEngine(build_test_tokenizer(), max_model_len=256, num_slots=8)
    with LiveServer(engine) as live:
        result = subprocess.run(
            [
                *schemathesis_command(),
                "run",
                f"{live.url}/openapi.json",
                "--checks",
                CHECKS,
                "--phases",
                "examples,fuzzing",
                "--max-examples",
                "25",
                "--seed",
                "11",
                "--workers",
                "2",
                "--request-timeout",
                "30",
                "--generation-database",
                "none",
                "--no-color",
                "--suppress-health-check",
                "all",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "No issues found" in output, output[-3000:]
    assert engine.slots_free == engine.num_slots  # and nothing left holding engine capacity
