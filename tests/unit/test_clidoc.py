"""docs/cli.md is what the parsers say now: a flag added, renamed or given another default
without regenerating the page fails here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_reference_is_current():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run([sys.executable, "-m", "tandem.clidoc"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert result.stdout == committed, "docs/cli.md is stale: run python -m tandem.clidoc > docs/cli.md"


def test_every_subcommand_and_service_flag_is_documented():
    text = (ROOT / "docs" / "cli.md").read_text()
    for command in ("target", "draft", "router", "up", "generate", "health", "certs", "models", "bench", "train-draft"):
        assert f"## `tandem {command}`" in text, command
    for flag in ("--tls-cert", "--api-key-file", "--max-running-requests", "--health-port", "--shutdown-grace-s"):
        assert f"`{flag}" in text, flag
