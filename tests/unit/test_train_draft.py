"""`tandem train-draft` in quick mode on a tiny target: the ShareGPT parser on a cut-off file,
the chunked cross-entropy against torch's, batched greedy answers equal to transformers'
`generate`, EAGLE and Medusa training that lowers the loss and writes heads tandem's loaders
load (and that compute what the serving code computes), resume (step and optimizer state),
and --max-minutes ending with a checkpoint. One tiny target and one data folder are shared.
"""

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from draft_service.config import DraftConfig
from draft_service.medusa_engine import medusa_choices
from tandem.attention.base import SequenceSlice
from tandem.attention.torch_backend import TorchAttention
from tandem.cli import build_parser
from tandem.errors import InvalidArgument
from tandem.kv.cache import PagedKVCache
from tandem.loops import LOOP_SHARE, loop_start, loops, repeated_ngram_share
from tandem.models.eagle import load_eagle_head
from tandem.models.eagle_io import D2T_FILE
from tandem.models.llama import ForwardBatch
from tandem.models.medusa import CHOICES_FILE, load_medusa_heads
from tandem.spec.token_tree import sorted_choices
from tandem.testing.tiny import build_tiny_model
from tandem.train.cli_args import config_from_args
from tandem.train.dataset import ShardedData
from tandem.train.eagle_head import upgrade_one_layer_checkpoint
from tandem.train.loop import load_checkpoint, save_checkpoint
from tandem.train.losses import IGNORE, linear_cross_entropy, linear_soft_cross_entropy, sampled_acceptance
from tandem.train.acceptance import (STATIC_TREE_SIZES, anchor_rows, best_static_tree, chain_metrics, draft_ranks,
                                     merge_parts, static_tree_lengths, static_tree_metrics, walk_histogram)
from tandem.train.methods import DRAFT_METHODS
from tandem.train.mtbench_eval import evaluate_with_loops
from tandem.train import selfdistill
from tandem.train.run import evaluate_head, run_train_draft
from tandem.train.selfdistill import (DataSpec, answers_path, eos_ids, features_path, final_features, greedy_batch,
                                      render_prompt, water_fill)
from tandem.train.sharegpt import first_user_turns, iter_complete_objects, second_user_turns

CUT_OFF = """[
  {"id": "a", "conversations": [{"from": "human", "value": " Hello, [there] {you} "}, {"from": "gpt", "value": "Hi"}]},
  {"id": "b", "conversations": [{"from": "gpt", "value": "(continued)"}, {"from": "human", "value": "Next?"}]},
  {"id": "c", "conversations": [{"from": "human", "value": "Hello, [there] {you}"}]},
  {"id": "d", "conversations": []},
  {"id": "e", "conversations": [{"from": "human", "value": "cut off her"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def quick_config(tiny, out, data_dir, *flags, **changes):
    args = build_parser().parse_args(["train-draft", "--quick", "--model", str(tiny), "--out", str(out),
                                      "--data-dir", str(data_dir), *flags])
    cfg, _ = config_from_args(args)
    return dataclasses.replace(cfg, show_progress=False, **changes)


def train_quick(cfg) -> dict:
    return run_train_draft(cfg, None, log=lambda m: None)


def full_data_loss(cfg, state: dict | None) -> float:
    """The method's loss over all training sequences, for a fresh head (the run's seeded
    initialisation) or one loaded with `state`."""
    data = ShardedData(cfg.data_dir, list(range(1, cfg.data.num_shards)), aux_layers=cfg.aux_layers)
    method = DRAFT_METHODS[cfg.method](cfg)
    module = method.build(data, state)
    if state:
        module.load_state_dict(state)
    with torch.no_grad():
        return method.loss(module, data.batch(range(len(data))))[0].item()


@pytest.fixture(scope="module")
def eagle_run(tiny, data_dir, tmp_path_factory):
    cfg = quick_config(tiny, tmp_path_factory.mktemp("eagle"), data_dir, "--method", "eagle")
    return cfg, train_quick(cfg)


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


def test_linear_cross_entropy_matches_torch():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2500, 16, generator=gen, requires_grad=True)  # > one chunk of rows
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 40, (2500,), generator=gen)
    labels[::7] = IGNORE
    loss, hits, count = linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    want = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    want.backward()
    assert count == int((labels != IGNORE).sum())
    assert torch.allclose(loss, want, atol=1e-5)
    assert torch.equal(hits, (logits.argmax(-1) == labels) & (labels != IGNORE))
    assert torch.allclose(got[0], hidden.grad, atol=1e-6) and torch.allclose(got[1], weight.grad, atol=1e-6)


def test_linear_soft_cross_entropy_is_the_kl_from_the_teachers_distribution():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2500, 16, generator=gen, requires_grad=True)  # > one chunk of rows
    teacher = torch.randn(2500, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    loss = linear_soft_cross_entropy(hidden, weight, teacher)
    loss.backward()
    got = hidden.grad.clone()
    hidden.grad = None
    want = F.kl_div(F.log_softmax(hidden @ weight.T, -1), F.log_softmax(teacher @ weight.T, -1),
                    log_target=True, reduction="batchmean")
    want.backward()
    assert torch.allclose(loss, want, atol=1e-5) and torch.allclose(got, hidden.grad, atol=1e-7)
    assert linear_soft_cross_entropy(teacher, weight, teacher).abs() < 1e-5  # the teacher itself: no loss


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions():
    gen = torch.Generator().manual_seed(2)
    hidden, teacher = torch.randn(1500, 8, generator=gen), torch.randn(1500, 8, generator=gen)
    lm_head = torch.randn(30, 8, generator=gen)
    columns = torch.tensor([1, 4, 5, 9, 20, 29])  # a pruned draft vocabulary
    got = sampled_acceptance(hidden, lm_head[columns], teacher, lm_head, columns)
    q = torch.softmax(hidden @ lm_head[columns].T, -1)
    p = torch.softmax(teacher @ lm_head.T, -1)
    assert torch.allclose(got, torch.minimum(p[:, columns], q).sum(-1), atol=1e-6)
    assert (got <= p[:, columns].sum(-1) + 1e-6).all()  # mass outside the draft vocabulary is never accepted
    same = sampled_acceptance(teacher, lm_head, teacher, lm_head, None)
    assert torch.allclose(same, torch.ones(1500), atol=1e-5)  # the target's own distribution: always accepted


def test_quick_eagle_with_soft_labels_lowers_the_loss(tiny, data_dir, tmp_path):
    cfg = quick_config(tiny, tmp_path / "soft", data_dir, "--method", "eagle", "--soft-labels", "--ttt-steps", "2")
    record = train_quick(cfg)
    assert cfg.soft_labels and record["status"] == "done"
    token_loss = [h["ce"] for h in record["history"]]  # the KL term alone falls, not only the feature loss
    assert token_loss[-1] < 0.8 * token_loss[0]
    # wiring: step 0's token loss is the KL from the distribution of the feature one position on
    data = ShardedData(cfg.data_dir, list(range(1, cfg.data.num_shards)))
    method = DRAFT_METHODS["eagle"](cfg)
    head, batch = method.build(data, None), data.batch(range(4))
    with torch.no_grad():
        _, metrics = method.loss(head, batch)
        mask = batch.answer_mask(2)
        predicted = head.unroll(batch.tokens, batch.features, 1)[0][mask]
        teacher = batch.features[:, 1:][mask[:, :-1]]
        want = F.kl_div(F.log_softmax(predicted @ head.lm_head.T, -1), F.log_softmax(teacher @ head.lm_head.T, -1),
                        log_target=True, reduction="batchmean")
    assert metrics["ce"] == pytest.approx(float(want), rel=1e-4)
    assert full_data_loss(cfg, load_checkpoint(cfg.run_dir)["model"]) < 0.9 * full_data_loss(cfg, None)
    assert "KL from the target's distribution" in (cfg.run_dir / "head" / "README.md").read_text()


def test_repeated_ngram_share_tells_a_loop_from_prose():
    assert repeated_ngram_share(list(range(40))) == 0
    assert repeated_ngram_share([7, 8] * 3, n=2) == pytest.approx(3 / 5)  # (7,8) (8,7) new; the other 3 repeat
    loop = list(range(10)) + [20, 21, 22] * 30  # a short answer that falls into a loop
    assert repeated_ngram_share(loop) > 0.8 and repeated_ngram_share([1, 2, 3]) == 0  # shorter than an 8-gram


def looped_copy(data_dir: Path, out: Path, shards=(0,)) -> Path:
    """A copy of a data folder whose `shards` have their first three answers looping: the first 2
    tokens as they were, then the next two over and over."""
    shutil.copytree(data_dir, out)
    for shard in shards:
        _loop_three(answers_path(out, shard))
    return out


def _loop_three(path: Path) -> None:
    with np.load(path) as z:
        answers = dict(z)
    starts = np.concatenate([[0], np.cumsum(answers["lengths"])])
    for i in range(3):
        begin, end = starts[i] + answers["prompt_lens"][i] + 2, starts[i + 1]
        answers["tokens"][begin:end] = np.resize(answers["tokens"][begin : begin + 2], end - begin)
    np.savez(path, **answers)


def test_loop_start_is_where_a_text_first_repeats_itself():
    text = list(range(10)) + [20, 21, 22] * 30
    assert loop_start(text) == 13 and loops(text)  # the 8-gram at 13 is the one at 10 again
    assert loop_start(list(range(40))) == 40 and not loops(list(range(40)))


def test_cut_loops_ends_the_answers_that_loop_where_they_first_repeat(eagle_run, tiny, tmp_path):
    cfg, _ = eagle_run
    folder = looped_copy(cfg.data_dir, tmp_path / "data", shards=(0, 1))
    whole, cut = ShardedData(folder, [0]), ShardedData(folder, [0], cut_loops=True)
    for i in range(len(whole)):
        answer = whole.answer_of(i).tolist()
        want = answer[: loop_start(answer)] if i < 3 else answer
        assert cut.answer_of(i).tolist() == want, i
    assert cut.answer_tokens < whole.answer_tokens
    batch, length = cut.batch([0, 3]), whole.rows[3][2]
    assert int(batch.lengths[0]) == cut.rows[0][2] and torch.equal(batch.tokens[1, :length], whole.batch([3]).tokens[0])
    runs = {flags: quick_config(tiny, tmp_path / f"run{len(flags)}", folder, *flags, "--steps", "1")
            for flags in ((), ("--cut-loops",))}
    plain, cutting = (train_quick(cfg)["data"] for cfg in runs.values())
    shard1 = ShardedData(folder, [1]).answer_tokens - ShardedData(folder, [1], cut_loops=True).answer_tokens
    assert plain["train_answer_tokens"] - cutting["train_answer_tokens"] == shard1 > 0  # its three loops cut
    assert "--cut-loops" in cutting["answers"] and "--cut-loops" not in plain["answers"]
    with pytest.raises(InvalidArgument, match="trained with --cut-loops; resume it the same way"):
        train_quick(dataclasses.replace(runs[("--cut-loops",)], steps=2, resume=True, cut_loops=False))


def test_the_evaluation_reports_answers_that_loop_apart(eagle_run, tmp_path):
    """The held-out answers with the first three's tokens made to loop (two tokens over and over)."""
    cfg, _ = eagle_run
    data = ShardedData(looped_copy(cfg.data_dir, tmp_path / "data"), [0])
    shares = [repeated_ngram_share(data.answer_of(i).tolist()) for i in range(len(data))]
    clean = [i for i, share in enumerate(shares) if share <= LOOP_SHARE]
    assert clean == list(range(3, len(data))), shares
    method = DRAFT_METHODS["eagle"](cfg)
    head = method.build(data, load_checkpoint(cfg.run_dir)["model"])
    head.load_state_dict(load_checkpoint(cfg.run_dir)["model"])
    with torch.no_grad():
        metrics = evaluate_with_loops(method, head, data, 3)
        apart = method.evaluate(head, [data.batch(clean)])
    assert metrics["looping_answers"] == len(data) - len(clean) and metrics["without_loops"]["answers"] == len(clean)
    for key in ("anchors", "walk_steps", "walk_accepted_length", "heldout_top1"):
        assert metrics["without_loops"][key] == pytest.approx(apart[key]), key
    assert metrics["anchors"] > apart["anchors"]


def test_tree_acceptance_counts_target_tokens_within_the_drafts_top_k():
    top = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    first = draft_ranks(top, torch.tensor([5, 6, 7, 8]), torch.ones(4, dtype=torch.bool))
    second = draft_ranks(top, torch.tensor([6, 5, 5, 5]), torch.tensor([True, False, True, True]))
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [1, 3, 0, 0]  # 3: absent or not an answer token
    got = chain_metrics([first, second], torch.zeros(4, dtype=torch.long))
    assert got["mean_accepted_length"] == (2 + 1 + 1 + 1) / 4 and got["accepted_rate_by_depth"] == [0.25, 0.0]
    assert got["tree_accepted_length"] == {"top2": (3 + 2 + 1 + 1) / 4, "top3": (3 + 2 + 3 + 1) / 4}
    assert got["tree_nodes"] == {"top2": 2 + 4, "top3": 3 + 9}
    # one sequence: the first step accepts 2 and skips anchor 1; the walk verifies from 0, 2 and 3
    assert got["walk_histograms"]["chain"] == [0, 2, 1, 0] and got["walk_accepted_length"] == (2 + 1 + 1) / 3
    assert got["walk_tree_accepted_length"] == {"top2": (3 + 1) / 2, "top3": (3 + 1) / 2}  # from 0 and 3
    assert got["walk_rate_by_depth"] == [round(1 / 3, 4), 0.0]
    halves = merge_parts([chain_metrics([first[:1], second[:1]], torch.zeros(1, dtype=torch.long)),
                     chain_metrics([first[1:], second[1:]], torch.ones(3, dtype=torch.long))])
    assert halves["tree_accepted_length"] == pytest.approx(got["tree_accepted_length"]) and halves["anchors"] == 4
    # two sequences walk apart: the second starts at its own first anchor (1), not where the first's step lands
    assert halves["walk_histograms"]["top3"] == [0, 1, 1, 1] and halves["walk_steps"] == 4


def test_a_static_tree_from_rank_statistics_keeps_the_paths_most_anchors_follow():
    # heads x anchors: ranks of the target's token (3: absent)
    ranks = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 0],
                          [0, 0, 1, 0, 3, 0, 0, 3]])
    assert best_static_tree(ranks, 3, 3) == ((0,), (1,), (0, 0))  # counts 4, 2, then (0,0) 2 before (2,) 1
    tree = best_static_tree(ranks, 5, 3)  # best first: then the count-1 paths, shallower first
    assert tree == ((0,), (1,), (0, 0), (2,), (0, 1))
    assert all(best_static_tree(ranks, n, 3) == tree[:n] for n in range(1, 6))  # every prefix: that size's best
    assert static_tree_lengths(ranks, ((0,), (0, 0)), 3).tolist() == [3, 3, 2, 1, 1, 1, 1, 2]
    # fit on sequence 0 (anchors 0-3), measured on sequence 1 (anchors 4-7)
    got = static_tree_metrics(ranks, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), 3, sizes=(2,))["2"]
    assert got["choices"] == [[0], [0, 0]] and got["mean_accepted_length"] == (1 + 1 + 1 + 2) / 4
    assert got["walk_accepted_length"] == (1 + 1 + 1 + 2) / 4  # every step here moves one anchor but the last
    default = static_tree_metrics(ranks, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), 3, sizes=())["default"]
    assert default["mean_accepted_length"] == (2 + 2 + 1 + 2) / 4  # (1, _), (2, 0): (2,) only, (3, 0): none, (0, _)


def test_the_walk_never_crosses_into_the_next_sequence():
    lengths = torch.tensor([3, 1, 1, 2, 2, 1, 3])  # sequences 0 (anchors 0-2), 1 (3-4), 2 (5-6)
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # 0: step of 3 overshoots its 3 anchors; 1: 2 then past the end; 2: 1 then 3
    assert walk_histogram(lengths, rows, 3) == [0, 1, 1, 2]
    assert anchor_rows(torch.tensor([[False, True, True], [True, False, False]])).tolist() == [0, 0, 1]


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


def test_quick_eagle_lowers_the_loss_and_writes_a_head_that_loads(eagle_run, tiny):
    cfg, record = eagle_run
    saved = load_checkpoint(cfg.run_dir)
    assert record["status"] == "done" and saved["step"] == cfg.steps == record["steps"]
    assert full_data_loss(cfg, saved["model"]) < 0.9 * full_data_loss(cfg, None)
    head = load_eagle_head(cfg.run_dir / "head", tiny, dtype=torch.float32, backend=TorchAttention())
    assert head.fc.weight.shape == (64, 128)
    written = json.loads((cfg.run_dir / "head" / "training.json").read_text())
    ev = written["evaluation"]
    assert 0 <= ev["heldout_top1"] <= 1 and ev["mean_accepted_length"] >= 1
    assert ev["tree_accepted_length"]["top3"] >= ev["tree_accepted_length"]["top2"] >= ev["mean_accepted_length"]
    t1 = ev["t1_accept_by_depth"]  # the chance of reaching each depth at temperature 1: falls with depth
    assert len(t1) == ev["chain_length"] and 1 > t1[0] >= t1[1] >= t1[2] >= t1[3] > 0
    assert ev["t1_accepted_length"] == pytest.approx(1 + sum(t1), abs=1e-3)
    assert (cfg.run_dir / "head" / "README.md").read_text().startswith("# eagle draft head")


def run_loaded_head(head, tokens, features):
    """One prefill of pairs (tokens [n] = t_{i+1}, features [n, D] = f_i) in the head's paged cache;
    returns the predicted features [n, D] and a function that decodes one more pair."""
    mc = head.model_config
    cache = PagedKVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                         num_pages=16, page_size=4, dtype=torch.float32)

    def step(toks, feats):
        cached = cache.allocator.length(1) if cache.allocator.has(1) else 0
        if not cache.allocator.has(1):
            cache.allocator.add(1)
        slots, copies = cache.allocator.append(1, len(toks))
        cache.apply_copies(copies)
        plan = head.backend.plan([SequenceSlice(cached, len(toks), cache.allocator.slots(1))], None)
        batch = ForwardBatch(toks, torch.arange(cached, cached + len(toks)), torch.tensor(slots), plan)
        return head.forward(toks, feats, batch, cache)

    return step(tokens, features), step


@pytest.mark.parametrize("layers", [1, 2])
def test_trained_eagle_head_computes_what_the_serving_head_computes(tiny, data_dir, tmp_path, layers):
    """Pruned vocabulary, 2 unrolled steps, layer from the target: the loaded head's prefill equals
    step 0 of the unroll, and a decode of (f^_{i+1}, t_{i+2}) equals step 1 at anchor i."""
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--ttt-steps", "2", "--draft-vocab", "100",
                       "--init-from-target", "--steps", "5", "--draft-layers", str(layers))
    train_quick(cfg)
    assert json.loads((cfg.run_dir / "head" / "config.json").read_text())["num_hidden_layers"] == layers
    assert json.loads((cfg.run_dir / "head" / "config.json").read_text())["draft_vocab_size"] == 100
    assert (cfg.run_dir / "head" / D2T_FILE).is_file()
    data = ShardedData(cfg.data_dir, [1])
    method = DRAFT_METHODS["eagle"](cfg)
    module = method.build(data, load_checkpoint(cfg.run_dir)["model"])
    module.load_state_dict(load_checkpoint(cfg.run_dir)["model"])
    batch, anchor = data.batch([0]), 6
    with torch.no_grad():
        step0, step1 = module.unroll(batch.tokens, batch.features, 2)
    head = load_eagle_head(cfg.run_dir / "head", tiny, dtype=torch.float32, backend=TorchAttention())
    tokens, feats = batch.tokens[0], batch.features[0]
    prefill, decode = run_loaded_head(head, tokens[1 : anchor + 2], feats[: anchor + 1])
    assert torch.allclose(prefill, step0[0, : anchor + 1], atol=1e-4)
    chained = decode(tokens[anchor + 2 : anchor + 3], prefill[-1:])
    assert torch.allclose(chained[0], step1[0, anchor], atol=1e-4)
    assert_the_head_folder_evaluates_as_its_run(cfg)


def assert_the_head_folder_evaluates_as_its_run(cfg):
    """--eval-head on a run's head folder (public format, pruned vocabulary) gives the held-out
    figures the run itself measured: the folder loads back into the trainer's module unchanged."""
    args = build_parser().parse_args(["train-draft", "--quick", "--method", cfg.method, "--eval-head",
                                      str(cfg.run_dir / "head"), "--out", str(cfg.run_dir / "re"),
                                      "--data-dir", str(cfg.data_dir), "--model", str(cfg.head_target_dir)])
    again, _ = config_from_args(args)
    got = evaluate_head(again, None, Path(args.eval_head), log=lambda m: None)["heldout"]
    want = json.loads((cfg.run_dir / "training.json").read_text())["evaluation"]
    assert got["walk_histograms"] == want["walk_histograms"] and got["anchors"] == want["anchors"]
    for key in ("heldout_top1", "mean_accepted_length", "walk_accepted_length"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert json.loads((cfg.run_dir / "re" / "evaluation.json").read_text())["heldout"]["walk_steps"] == got["walk_steps"]


def test_quick_medusa_lowers_the_loss_and_writes_heads_that_load(tiny, data_dir, tmp_path):
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--method", "medusa")
    record = train_quick(cfg)
    saved = load_checkpoint(cfg.run_dir)
    assert record["status"] == "done" and saved["step"] == cfg.steps
    assert full_data_loss(cfg, saved["model"]) < 0.9 * full_data_loss(cfg, None)
    heads = load_medusa_heads(cfg.run_dir / "head", tiny, dtype=torch.float32)
    assert heads.num_heads == 4 and heads.lm_heads is not None  # own lm_heads (Medusa-1)
    # its own tree: the largest static tree the held-out evaluation fit, best first, served as the default
    fit = record["evaluation"]["static_trees"][str(max(STATIC_TREE_SIZES))]["choices"]
    assert json.loads((cfg.run_dir / "head" / CHOICES_FILE).read_text()) == fit
    assert CHOICES_FILE in (cfg.run_dir / "head" / "README.md").read_text()
    served = DraftConfig(method="medusa", model_dir=cfg.run_dir / "head", target_model_dir=tiny, shape="tree", tree_node_budget=5)
    assert medusa_choices(served, heads.num_heads) == sorted_choices(fit[:5])
    module = DRAFT_METHODS["medusa"](cfg).build(ShardedData(cfg.data_dir, [0]), None)
    module.load_state_dict(saved["model"])
    x = torch.randn(5, 64)
    with torch.no_grad():
        want = torch.stack([h @ module.head_weight(i).T for i, h in enumerate(module.hidden(x))], dim=1)
    assert torch.allclose(heads.logits(x), want, atol=1e-4)
    assert_the_head_folder_evaluates_as_its_run(cfg)


def test_medusa_with_a_pruned_vocabulary_drafts_as_its_evaluation_does(tiny, data_dir, tmp_path):
    """--draft-vocab for Medusa writes the map of the most frequent answer tokens; the loaded heads
    rank only those, and their best tokens are the ones the trainer's evaluation drafts."""
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--method", "medusa", "--medusa-lm-head", "shared",
                       "--draft-vocab", "50", "--steps", "5")
    train_quick(cfg)
    heads = load_medusa_heads(cfg.run_dir / "head", tiny, dtype=torch.float32)
    data = ShardedData(cfg.data_dir, list(range(1, cfg.data.num_shards)))
    counts = data.answer_token_counts(heads.config.vocab_size)
    assert len(heads.vocab_ids) == 50 and counts[heads.vocab_ids].min() >= counts.sort().values[-50]
    method = DRAFT_METHODS["medusa"](cfg)
    module = method.build(data, None)
    module.load_state_dict(load_checkpoint(cfg.run_dir)["model"])
    x = torch.randn(7, 64)
    with torch.no_grad():
        want = torch.stack([method._draft(h, module.head_weight(i)) for i, h in enumerate(module.hidden(x))], dim=1)
    assert torch.equal(heads.logits(x).topk(want.shape[-1], dim=-1).indices, want)
    assert set(want.flatten().tolist()) <= set(heads.vocab_ids.tolist())
    assert_the_head_folder_evaluates_as_its_run(cfg)


def test_resume_continues_the_step_count_and_the_optimizer_state(eagle_run, tiny, data_dir, tmp_path):
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--steps", "4")
    train_quick(cfg)
    first = load_checkpoint(cfg.run_dir)
    assert first["step"] == 4 and first["optimizer"]["state"][0]["step"].item() == 4
    with pytest.raises(InvalidArgument, match="--resume"):
        train_quick(cfg)
    record = train_quick(dataclasses.replace(cfg, steps=7, resume=True))
    second = load_checkpoint(cfg.run_dir)
    assert second["step"] == 7 and record["steps"] == 7
    assert second["optimizer"]["state"][0]["step"].item() == 7  # a fresh optimizer would say 3
    assert second["history"][: len(first["history"])] == first["history"]
    assert [s["step_from"] for s in record["sittings"]] == [0, 4]
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["latest.json", "step-0000007.pt"]


def test_max_minutes_ends_the_sitting_with_a_checkpoint(eagle_run, tiny, data_dir, tmp_path):
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--steps", "1000000", "--max-minutes", "0.001")
    record = train_quick(cfg)
    saved = load_checkpoint(cfg.run_dir)
    assert record["status"] == "time limit"
    assert 0 < saved["step"] == record["steps"] < cfg.steps
    assert (cfg.run_dir / "head" / "model.safetensors").is_file()
    assert json.loads((cfg.run_dir / "training.json").read_text())["status"] == "time limit"


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


def test_init_head_trains_on_from_a_heads_weights_and_vocabulary(tiny, data_dir, tmp_path):
    base = quick_config(tiny, tmp_path / "base", data_dir, "--draft-vocab", "100", "--steps", "20")
    base_record = train_quick(base)
    on = quick_config(tiny, tmp_path / "on", data_dir, "--init-head", str(base.run_dir / "head"), "--steps", "3")
    record = train_quick(on)
    fresh = full_data_loss(base, None)
    start = full_data_loss(base, DRAFT_METHODS["eagle"](on).load(base.run_dir / "head").state_dict())
    assert start < 0.9 * fresh  # the base head's weights, not a fresh initialisation
    assert record["history"][0]["loss"] == pytest.approx(base_record["history"][-1]["loss"], rel=0.2)
    assert load_checkpoint(on.run_dir)["model"]["d2t"].tolist() == load_checkpoint(base.run_dir)["model"]["d2t"].tolist()
    resumed = train_quick(dataclasses.replace(on, steps=5, resume=True))  # the checkpoint's weights and map
    assert resumed["steps"] == 5
    card = (on.run_dir / "head" / "README.md").read_text()
    assert "started from the head in" in card and "pruned draft vocabulary of 100 tokens" in card
    with pytest.raises(InvalidArgument, match="--init-head"):
        train_quick(dataclasses.replace(on, steps=6, resume=True, init_head=None))


def test_init_head_grows_layers_that_start_out_adding_nothing(tiny, data_dir, tmp_path):
    base = quick_config(tiny, tmp_path / "base", data_dir, "--steps", "20")
    train_quick(base)
    head = base.run_dir / "head"
    grown = quick_config(tiny, tmp_path / "grown", data_dir, "--init-head", str(head), "--draft-layers", "2", "--steps", "3")
    module = DRAFT_METHODS["eagle"](grown).load(head)
    assert len(module.layers) == 2 and not module.layers[1].o_proj.weight.any()
    assert full_data_loss(grown, module.state_dict()) == full_data_loss(base, load_checkpoint(base.run_dir)["model"])
    record = train_quick(grown)
    assert record["draft_layers"] == 2 and "2 decoder layers" in (grown.run_dir / "head" / "README.md").read_text()
    served = load_eagle_head(grown.run_dir / "head", tiny, dtype=torch.float32, backend=TorchAttention())
    assert served.model_config.num_layers == 2
    assert train_quick(dataclasses.replace(grown, steps=5, resume=True, draft_layers=0))["steps"] == 5
    with pytest.raises(InvalidArgument, match="holds a 2-layer head"):
        train_quick(dataclasses.replace(grown, steps=6, resume=True, draft_layers=3))
    with pytest.raises(InvalidArgument, match="--draft-layers 1 is below the 2 layers"):
        DRAFT_METHODS["eagle"](dataclasses.replace(grown, draft_layers=1)).load(grown.run_dir / "head")


def test_a_checkpoint_from_before_the_layer_list_resumes(eagle_run, tmp_path):
    """Training checkpoints that named layer 0's parameters at the top level, with post_norm
    first in the optimizer's order, resume with every tensor in its place."""
    cfg, _ = eagle_run
    saved = load_checkpoint(cfg.run_dir)
    old = copy.deepcopy(saved)
    old["model"] = {k.removeprefix("layers.0."): v for k, v in saved["model"].items()}
    state = saved["optimizer"]["state"]  # now: fc.weight, fc.bias, post_norm, q_proj ...; then: post_norm first
    old["optimizer"]["state"] = {0: state[2], 1: state[0], 2: state[1], **{i: state[i] for i in range(3, len(state))}}
    upgraded = copy.deepcopy(old)
    upgrade_one_layer_checkpoint(upgraded)
    assert upgraded["model"].keys() == saved["model"].keys()
    for i, moments in saved["optimizer"]["state"].items():
        assert all(torch.equal(v, upgraded["optimizer"]["state"][i][k]) for k, v in moments.items())
    run = dataclasses.replace(cfg, run_dir=tmp_path / "run", steps=cfg.steps + 2, resume=True)
    shutil.copytree(cfg.run_dir, run.run_dir)
    save_checkpoint(run.run_dir, old)
    assert train_quick(run)["steps"] == cfg.steps + 2
    mismatched = dataclasses.replace(run, steps=cfg.steps + 4)
    broken = copy.deepcopy(saved)
    broken["optimizer"]["state"] = {0: state[2], 1: state[0], 2: state[1], **{i: state[i] for i in range(3, len(state))}}
    save_checkpoint(run.run_dir, broken)
    with pytest.raises(InvalidArgument, match="optimizer state has a moment of shape"):
        train_quick(mismatched)


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


@pytest.mark.parametrize("flags, message", [
    (["--method", "medusa"], "--method medusa"), (["--draft-vocab", "50"], "--draft-vocab"),
    (["--init-from-target"], "--init-from-target")])
def test_init_head_refuses_flags_it_would_ignore(tiny, tmp_path, flags, message):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=message):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--init-head", str(head), *flags)
    with pytest.raises(SystemExit, match="not a head folder"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--init-head", str(tmp_path / "nowhere"))


@pytest.mark.parametrize("flag, value", [("--skip-prompts", "-1"), ("--ttt-steps", "0"), ("--batch-size", "0"),
                                         ("--draft-layers", "0")])
def test_out_of_range_sizes_are_refused_by_name(tiny, tmp_path, flag, value):
    with pytest.raises(SystemExit, match=f"{flag} must be"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", flag, value)


def test_soft_labels_and_draft_layers_are_refused_for_medusa(tiny, tmp_path):
    with pytest.raises(SystemExit, match="--soft-labels is for EAGLE"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--method", "medusa", "--soft-labels")
    with pytest.raises(SystemExit, match="--draft-layers is for EAGLE"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--method", "medusa", "--draft-layers", "2")


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
