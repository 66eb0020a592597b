import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.testing.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct, fp32 (fetched and converted once; a no-op afterwards)."""
    from tandem.models.fetch import fetch_default_model, tandem_home

    return fetch_default_model(tandem_home(), log=lambda m: None)["float32"]


def tandem_cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env, **kw)
