"""Every `tandem ...` command in the README and docs/ is one the CLI accepts: a flag renamed or
removed makes the page that still shows it fail here."""

import re
import shlex
from pathlib import Path

import pytest

from tandem.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def _commands(page: Path) -> list[str]:
    """The `tandem` command lines of a page's code blocks, continuation lines joined."""
    out = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("tandem ") and "..." not in line:
                out.append(line)
    return out


CASES = [(page.name, line) for page in PAGES for line in _commands(page)]


def test_the_pages_show_commands():
    assert len(CASES) >= 15, CASES


@pytest.mark.parametrize("page, line", CASES, ids=[f"{p}: {c[:60]}" for p, c in CASES])
def test_a_documented_command_parses(page, line, monkeypatch):
    for var in ("TANDEM_LOG_LEVEL",):
        monkeypatch.delenv(var, raising=False)
    argv = shlex.split(line)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{line}` does not parse ({e})")
