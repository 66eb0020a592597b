"""The README's Python client runs as written against a real router (its address swapped for
this test's port): a doc example that lies fails the suite."""

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def test_the_readme_python_client_streams_a_completion(services):
    blocks = _python_blocks(ROOT / "README.md")
    assert blocks, "the README shows a Python client"
    for code in blocks:
        code = code.replace("127.0.0.1:50051", f"127.0.0.1:{services.router_port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
        assert len(out.getvalue()) > 0
