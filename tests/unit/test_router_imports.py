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
