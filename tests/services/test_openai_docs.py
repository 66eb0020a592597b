"""docs/openai.md's examples run as written against a real router's HTTP API (its address
swapped for this test's port, the model served under the default model's name): the OpenAI SDK
example in-process, the curl command with curl."""

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.services.test_openai_api import http_services

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "openai.md"
DOC_BASE = "http://127.0.0.1:8000"
DOC_MODEL = "SmolLM2-135M-Instruct"
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[str]:
    return [code for found, code in FENCE.findall(PAGE.read_text()) if found == lang]


@pytest.fixture(scope="module")
def services(tiny_model):
    s = http_services(tiny_model, served_model_name=DOC_MODEL)
    yield s
    s.stop()


def _here(code: str, services) -> str:
    assert DOC_BASE in code and DOC_MODEL in code, "the example calls `tandem up`'s port and the default model"
    return code.replace(DOC_BASE, services.base_url.removesuffix("/v1"))


def test_the_openai_sdk_example_streams_text(services):
    blocks = _blocks("python")
    assert blocks, "docs/openai.md shows the OpenAI SDK"
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(_here(code, services), "docs/openai.md", "exec"), {})
        assert out.getvalue().strip()


def test_the_curl_example_answers(services):
    blocks = [code for code in _blocks("sh") if code.startswith("curl ")]
    assert blocks, "docs/openai.md shows curl"
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    for code in blocks:
        done = subprocess.run(["bash", "-euc", _here(code, services)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
