"""`tandem train-draft` in quick mode on a tiny target: the chunked cross-entropy against
torch's, EAGLE and Medusa training that lowers the loss and writes heads tandem's loaders load
(and that compute what the serving code computes), resume (step and optimizer state), and
--max-minutes ending with a checkpoint. One tiny target and one data folder are shared
(tests/unit/train_helpers.py; the data itself: test_train_data.py)."""

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from draft_service.config import DraftConfig
from draft_service.medusa_engine import medusa_choices
from tandem.attention.base import SequenceSlice
from tandem.attention.torch_backend import TorchAttention
from tandem.cli import build_parser
from tandem.errors import InvalidArgument
from tandem.kv.cache import PagedKVCache
from tandem.loops import LOOP_SHARE, loop_start, repeated_ngram_share
from tandem.models.eagle import load_eagle_head
from tandem.models.eagle_io import D2T_FILE
from tandem.models.llama import ForwardBatch
from tandem.models.medusa import CHOICES_FILE, load_medusa_heads
from tandem.spec.token_tree import sorted_choices
from tandem.train.cli_args import config_from_args
from tandem.train.dataset import ShardedData
from tandem.train.eagle_head import upgrade_one_layer_checkpoint
from tandem.train.loop import load_checkpoint, save_checkpoint
from tandem.train.losses import IGNORE, linear_cross_entropy, linear_soft_cross_entropy
from tandem.train.acceptance import STATIC_TREE_SIZES
from tandem.train.methods import DRAFT_METHODS
from tandem.train.mtbench_eval import evaluate_with_loops
from tandem.train.run import evaluate_head
from tandem.train.selfdistill import answers_path
from tests.unit.train_helpers import data_dir, quick_config, tiny, train_quick  # noqa: F401 (fixtures)


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


