"""The router carries no tensor: importing it (its server, engine, speculation and codec) and
tokenizing with it load no torch, so a router scaled on its own needs neither torch's install
nor its memory."""

import subprocess
import sys

from tandem.testing.tiny import build_tokenizer

PROBE = ("import sys, router.server, router.engine, router.speculation, tandem.codec\n"
         "from router.tokenizer import Tokenizer\n"
         "t = Tokenizer(sys.argv[1]); t.encode_chat([('user', 'hi')]); t.hf.decode(t.encode_prompt('hi'))\n"
         "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")


def test_the_router_loads_no_torch(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_services_import_nothing_from_one_another():
    """Shared pieces live in tandem/: a service folder imports no other service's modules."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    services = ("router", "target_service", "draft_service")
    for service in services:
        for path in (root / service).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            foreign = [n for n in names if n.split(".")[0] in services and n.split(".")[0] != service]
            assert not foreign, (str(path.relative_to(root)), foreign)
