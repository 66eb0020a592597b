"""`tandem train-draft` as a real process: quick mode (a tiny target it builds itself, built-in
prompts) for both methods, TANDEM_TRAIN_* fallbacks, a resumed sitting; and, marked slow, a
few steps on the real default model and ShareGPT, evaluated on MT-bench answers too."""

import json

import pytest
import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.models.eagle import load_eagle_head
from tandem.models.medusa import load_medusa_heads
from tests.e2e.conftest import tandem_cli


def checkpoint_step(run_dir) -> int:
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"]


def test_quick_eagle_then_medusa_on_the_same_data_and_a_resumed_sitting(tmp_path, monkeypatch):
    eagle, medusa = tmp_path / "eagle", tmp_path / "medusa"
    done = tandem_cli("train-draft", "--quick", "--out", str(eagle))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("done: step 30/30")
    target = eagle / "tiny-target"
    load_eagle_head(eagle / "head", target, dtype=torch.float32, backend=TorchAttention())

    monkeypatch.setenv("TANDEM_TRAIN_STEPS", "6")
    args = ("train-draft", "--quick", "--method", "medusa", "--model", str(target), "--out", str(medusa),
            "--data-dir", str(eagle / "data"))
    first = tandem_cli(*args)
    assert first.returncode == 0, first.stderr
    assert checkpoint_step(medusa) == 6 and "self-distill" not in first.stderr  # data reused, not redone
    again = tandem_cli(*args, "--steps", "9", "--resume")
    assert again.returncode == 0, again.stderr
    assert checkpoint_step(medusa) == 9
    record = json.loads((medusa / "head" / "training.json").read_text())
    assert [s["step_from"] for s in record["sittings"]] == [0, 6]
    assert load_medusa_heads(medusa / "head", target, dtype=torch.float32).num_heads == 4


@pytest.mark.slow
def test_a_few_steps_on_the_default_model_and_sharegpt(tmp_path, default_model):
    out = tmp_path / "run"
    done = tandem_cli("train-draft", "--out", str(out), "--data-dir", str(tmp_path / "data"), "--num-prompts", "96",
                      "--max-new-tokens", "16", "--max-prompt-tokens", "64", "--steps", "3", "--batch-size", "4",
                      "--draft-vocab", "4096", "--eval-mtbench", "2", timeout=600)
    assert done.returncode == 0, done.stderr
    assert checkpoint_step(out) == 3
    mtbench = json.loads((out / "training.json").read_text())["evaluation"]["mtbench"]
    assert set(mtbench) == {"bfloat16", "float32"}  # the training features' dtype and a served fp32 target's
    assert all(m["questions"] == 2 and m["anchors"] > 0 for m in mtbench.values())
    assert all(0 <= m["looping_answers"] <= 2 for m in mtbench.values())  # repetition loops, reported apart
    assert "MT-bench questions" in (out / "head" / "README.md").read_text()
    head = load_eagle_head(out / "head", default_model, dtype=torch.float32, backend=TorchAttention())
    assert head.config.hidden_size == 576
    assert json.loads((out / "head" / "config.json").read_text())["draft_vocab_size"] == 4096
