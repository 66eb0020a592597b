"""docs/cli.md, written from the command line's own parsers: `python -m tandem.clidoc >
docs/cli.md`. tests/unit/test_clidoc.py fails when the committed page differs from what the
parsers say now, so the reference cannot go stale."""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HEADER = """# Command-line reference

Generated from the argument parsers by `python -m tandem.clidoc > docs/cli.md` (a test fails
when this page is stale). Every flag of the services falls back to a `TANDEM_*` environment
variable (mostly the flag's name: `--max-waiting` is `TANDEM_MAX_WAITING`; a service's `--port`
and `--host` are `TANDEM_<SERVICE>_PORT` and `TANDEM_<SERVICE>_HOST`); defaults below are those
of an environment without them. OpenTelemetry reads the standard `OTEL_*` variables.
"""


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return "off" if not action.default else "on"
    return f"`{action.default}`"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    choices = f" {{{', '.join(map(str, action.choices))}}}" if action.choices else ""
    return f"`{', '.join(action.option_strings)}{metavar if not choices else ''}`{choices}"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _section(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    lines = [f"## `tandem {name}`", "", _cell(summary) + ("." if summary and not summary.endswith(".") else ""), "",
             "| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        lines.append(f"| {_flag(action)} | {_default(action)} | {_cell(action.help)} |")
    return [*lines, ""]


def render() -> str:
    from tandem.cli import build_parser

    parser = build_parser()
    out = [HEADER, "## `tandem`", "", "| flag | default | meaning |", "|---|---|---|"]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out += [f"| {_flag(a)} | {_default(a)} | {_cell(a.help)} |" for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]
    out.append("")
    summaries = {c.dest: c.help for c in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        out += _section(name, sub, summaries.get(name, ""))
    text = "\n".join(out).rstrip() + "\n"
    return text.replace(f"{ROOT}/", "")  # paths in the checkout, wherever it is


def clean_environment() -> None:
    """Defaults as documented: no TANDEM_* variable of this shell."""
    for key in [k for k in os.environ if k.startswith("TANDEM_")]:
        del os.environ[key]


if __name__ == "__main__":
    clean_environment()
    sys.stdout.write(render())
