"""The self-distilled data of `tandem train-draft`: the ShareGPT parser on a cut-off file, second
turns, prompts cut to fit, batched greedy answers equal to transformers' `generate`, and data
folders (--skip-prompts, --extra-data, --answers-from)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.errors import InvalidArgument
from tandem.testing.tiny import build_tiny_model
from tandem.train import selfdistill
from tandem.train.selfdistill import (DataSpec, answers_path, eos_ids, features_path, final_features, greedy_batch,
                                      render_prompt, water_fill)
from tandem.train.sharegpt import first_user_turns, iter_complete_objects, second_user_turns
from tests.unit.train_helpers import data_dir, quick_config, tiny, train_quick  # noqa: F401 (fixtures)


CUT_OFF = """[
  {"id": "a", "conversations": [{"from": "human", "value": " Hello, [there] {you} "}, {"from": "gpt", "value": "Hi"}]},
  {"id": "b", "conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "Next?"}]},
  {"id": "c", "conversations": [{"from": "human", "value": "Hello, [there] {you}"}]},
  {"id": "d", "conversations": []},
  {"id": "e", "conversations": [{"from": "human", "value": "cut off her"""


def test_sharegpt_parser_keeps_complete_objects_of_a_cut_off_array():
    conversations = list(iter_complete_objects(CUT_OFF))
    assert [c["id"] for c in conversations] == ["a", "b", "c", "d"]
    assert first_user_turns(conversations) == ["Hello, [there] {you}", "Next?"]
    assert [c["id"] for c in iter_complete_objects('[{"id": 1}, {"id": 2}]')] == [1, 2]


def test_second_turns_follow_the_first_exchange():
    conversations = [
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": " A1 "},
                           {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
        {"conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "Q3"},
                           {"from": "gpt", "value": "A3"}, {"from": "human", "value": "Q4"}]},
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                           {"from": "human", "value": "Q2"}]},  # a duplicate
        {"conversations": [{"from": "human", "value": "Q5"}, {"from": "gpt", "value": ""},
                           {"from": "human", "value": "Q6"}]},  # an empty answer
        {"conversations": [{"from": "human", "value": "Q7"}, {"from": "gpt", "value": "A7"}]},
    ]
    assert second_user_turns(conversations) == [("Q1", "A1", "Q2"), ("Q3", "A3", "Q4")]


def test_a_long_conversation_is_cut_to_fit_with_its_generation_prompt(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = ("Tell me about cats " * 30, "Cats are small furry animals " * 40, "And dogs?")
    ids = render_prompt(tokenizer, prompt, 160)
    text = tokenizer.decode(ids)
    assert 140 <= len(ids) <= 160 and text.endswith("<|im_start|>assistant\n") and "And dogs?" in text
    assert text.count("Tell me about cats") > 1 and text.count("Cats are small") > 1  # both long turns kept in part
    assert water_fill([203, 287, 26], 200) == [87, 87, 26] and water_fill([5, 6], 100) == [5, 6]


def test_turn_two_data_is_other_data(tiny, tmp_path):
    spec = DataSpec(tiny, "float32", False, 96, 256, 256, 96, 48, 8192)
    assert "turn" not in spec.identity() and dataclasses.replace(spec, turn=2).identity()["turn"] == 2
    with pytest.raises(SystemExit, match="--turn 2"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--turn", "2")


def test_batched_greedy_answers_equal_generate(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompts = [render_prompt(tokenizer, text, 40) for text in ("Hi", "Tell me a long story about a cat " * 9, "Why?")]
    assert 36 <= len(prompts[1]) <= 40  # cut to fit, its generation prompt kept
    assert tokenizer.decode(prompts[1]).endswith("<|im_start|>assistant\n")
    answers = greedy_batch(model, prompts, 12, eos_ids(model, tokenizer))
    for prompt, answer in zip(prompts, answers):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        assert answer == out[0, len(prompt):].tolist()


def test_skip_prompts_moves_the_training_shards_and_keeps_the_held_out_one(tiny, tmp_path):
    cfg = quick_config(tiny, tmp_path / "run", tmp_path / "data", "--num-prompts", "8", "--skip-prompts", "8",
                       "--steps", "1")
    train_quick(cfg)
    shards = [np.load(answers_path(cfg.data_dir, k))["prompt_index"].tolist() for k in (0, 1)]
    assert shards == [list(range(0, 8)), list(range(16, 24))]  # prompts 8-15 left out
    assert json.loads((cfg.data_dir / "meta.json").read_text())["skip_prompts"] == 8
    unskipped = quick_config(tiny, tmp_path / "other", tmp_path / "data", "--num-prompts", "8", "--steps", "1")
    with pytest.raises(InvalidArgument, match=r"differs in \['skip_prompts'\]"):
        train_quick(unskipped)
    too_far = quick_config(tiny, tmp_path / "far", tmp_path / "far-data", "--num-prompts", "8", "--skip-prompts", "24")
    with pytest.raises(InvalidArgument, match="--skip-prompts 24"):
        train_quick(too_far)
    assert not (tmp_path / "far-data").exists()  # a refused run leaves no empty data folder behind


def test_extra_data_trains_on_another_folders_shards_and_keeps_the_held_out_one(tiny, data_dir, tmp_path):
    other = quick_config(tiny, tmp_path / "other", tmp_path / "other-data", "--num-prompts", "8",
                         "--skip-prompts", "16", "--steps", "1")
    train_quick(other)  # other data: prompts 24-31 of the quick set, in a folder of its own
    own = quick_config(tiny, tmp_path / "own", data_dir, "--steps", "1")
    both = quick_config(tiny, tmp_path / "both", data_dir, "--extra-data", str(other.data_dir), "--steps", "1")
    own_data, both_data = train_quick(own)["data"], train_quick(both)["data"]
    assert both_data["train_sequences"] == own_data["train_sequences"] + 8
    assert both_data["extra"] == [{"dir": str(other.data_dir), "train_sequences": 8,
                                   "source": "built-in prompts (quick mode)"}]
    assert both_data["heldout_sequences"] == own_data["heldout_sequences"]  # still --data-dir's shard 0
    assert json.loads((both.run_dir / "run.json").read_text())["extra_data"] == [str(other.data_dir)]
    assert "and 8 sequences of built-in prompts" in (both.run_dir / "head" / "README.md").read_text()


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "no meta.json"),
    (lambda d: (d / "meta.json").write_text(json.dumps({**json.loads((d.parent / "ok" / "meta.json").read_text()),
                                                         "target_dtype": "bfloat16"})), r"differs in \['target_dtype'\]"),
    (lambda d: (d / "meta.json").write_text((d.parent / "ok" / "meta.json").read_text()), "no complete training shard")])
def test_extra_data_refuses_folders_it_cannot_train_on(tiny, tmp_path, make, message):
    ok = quick_config(tiny, tmp_path / "run", tmp_path / "ok", "--num-prompts", "8", "--steps", "1")
    train_quick(ok)
    bad = tmp_path / "bad"
    bad.mkdir()
    make(bad)
    with pytest.raises(InvalidArgument, match=message):
        train_quick(quick_config(tiny, tmp_path / "run2", ok.data_dir, "--extra-data", str(bad), "--steps", "1"))
    with pytest.raises(InvalidArgument, match="the run's own --data-dir"):
        train_quick(quick_config(tiny, tmp_path / "run3", ok.data_dir, "--extra-data", str(ok.data_dir)))


def test_answers_from_the_other_dtype_are_copied_and_only_the_features_are_made(tmp_path, monkeypatch):
    """Features in the dtype the head will be served with, on answers another dtype made."""
    bf16 = build_tiny_model(tmp_path / "tiny" / "bfloat16", dtype=torch.bfloat16)
    fp32 = build_tiny_model(tmp_path / "tiny" / "float32")
    made = quick_config(bf16, tmp_path / "made", tmp_path / "bf16-data", "--target-dtype", "bfloat16",
                        "--num-prompts", "8", "--steps", "1")
    train_quick(made)
    run = quick_config(fp32, tmp_path / "run", tmp_path / "fp32-data", "--answers-from", str(made.data_dir),
                       "--num-prompts", "8", "--steps", "1")
    with monkeypatch.context() as m:
        m.setattr(selfdistill, "make_answers", lambda *a: pytest.fail("generated an answer"))
        record = train_quick(run)
    model = AutoModelForCausalLM.from_pretrained(fp32).eval()
    for k in (0, 1):
        assert answers_path(run.data_dir, k).read_bytes() == answers_path(made.data_dir, k).read_bytes()
        shard = np.load(answers_path(run.data_dir, k))
        seqs = np.split(shard["tokens"], np.cumsum(shard["lengths"])[:-1])
        with torch.inference_mode():
            states = np.concatenate(final_features(model, [s.tolist() for s in seqs], run.data.feature_batch_tokens))
        ours, theirs = np.load(features_path(run.data_dir, k)), np.load(features_path(made.data_dir, k))
        assert np.array_equal(ours, states) and not np.array_equal(ours, theirs)  # the float32 target's
    assert json.loads((run.data_dir / "meta.json").read_text())["answers_dtype"] == "bfloat16"
    assert record["data"]["answers"].startswith("the target's own greedy answers (bfloat16)")
    assert record["data"]["source"].endswith("; answers of the bfloat16 target, hidden states of the float32 one")
    chained = quick_config(bf16, tmp_path / "chained", tmp_path / "chained-data", "--target-dtype", "bfloat16",
                           "--answers-from", str(run.data_dir), "--num-prompts", "8", "--steps", "1")
    with pytest.raises(InvalidArgument, match="answers of the bfloat16 target"):
        train_quick(chained)  # the float32 folder's answers are the bfloat16 target's
    same = quick_config(bf16, tmp_path / "same", tmp_path / "same-data", "--target-dtype", "bfloat16",
                        "--answers-from", str(made.data_dir), "--num-prompts", "8", "--steps", "1")
    with pytest.raises(InvalidArgument, match="not made by this target in its other dtype"):
        train_quick(same)
    other = quick_config(fp32, tmp_path / "other", tmp_path / "other-data", "--answers-from", str(made.data_dir),
                         "--num-prompts", "8", "--skip-prompts", "8", "--steps", "1")
    with pytest.raises(InvalidArgument, match=r"answers other prompts \(differs in \['skip_prompts'\]\)"):
        train_quick(other)
    more = quick_config(fp32, tmp_path / "more", tmp_path / "more-data", "--answers-from", str(made.data_dir),
                        "--num-prompts", "16", "--steps", "1")
    with pytest.raises(InvalidArgument, match=r"no answers for shards \[2\]"):
        train_quick(more)
