"""Medusa heads and the Medusa draft engine.

Heads: checkpoints written in the public format (Medusa's own module layout: a ModuleList of
Sequential(ResBlock..., Linear(D, V, bias=False)), its state dict saved as is, or without the
lm_head weights when the heads share the target's) load, and their logits equal that module's
output; save/load round trips; bad checkpoints fail with InvalidArgument.

Engine: a hand-made head whose top-k per head is known (no residual effect, one-hot features
select one lm_head column) drafts literal trees and chains with parents, pruned by num_tokens.
"""

import json
import queue
from pathlib import Path

import pytest
import torch
from torch import nn

from draft_service.config import DraftConfig
from draft_service.medusa_engine import MedusaDraftEngine, medusa_choices
from draft_service.peer_client import DraftPeer
from tandem.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tandem.models.medusa import (
    CHOICES_FILE,
    MedusaConfig,
    MedusaHeads,
    load_medusa_heads,
    random_medusa_checkpoint,
    save_medusa_checkpoint,
    target_lm_head,
)
from tandem.models.config import ModelConfig
from tandem.ops import AddSequence, DraftRequest, DraftSeq, ForkSequence, PopTokens, RemoveSequence
from tandem.peer import HiddenPairs, HiddenStep
from tandem.sampling.params import SamplingParams
from tandem.spec.token_tree import SMALL_STATIC_TREE
from tandem.testing.drafts import save_medusa_heads
from tandem.testing.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def untied_target(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "untied", tie_word_embeddings=False)


# -- the public format, as Medusa's own code builds it ----------------------------------------


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class ReferenceMedusa(nn.Module):
    """Medusa-1's heads module (medusa_model.py), each head with its own residual blocks."""

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int, seed: int):
        super().__init__()
        self.medusa_head = nn.ModuleList([
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        ])  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)

    def forward(self, hidden):  # [S, D] -> [S, H, V]
        return torch.stack([head(hidden) for head in self.medusa_head], dim=1)


def write_reference(out_dir, target_dir, *, heads=3, layers=1, shared=False, fmt="safetensors", seed=0):
    """A reference module and its checkpoint; `shared`: lm_heads = the target's, not saved."""
    mc = ModelConfig.from_folder(target_dir)
    ref = ReferenceMedusa(heads, layers, mc.hidden_size, mc.vocab_size, seed)
    state = ref.state_dict()
    if shared:
        with torch.no_grad():
            for head in ref.medusa_head:
                head[-1].weight.copy_(target_lm_head(mc, target_dir))
        state = {k: v for k, v in state.items() if not k.endswith(f".{layers}.weight")}
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "hidden_size": mc.hidden_size,
              "vocab_size": mc.vocab_size, "base_model_name_or_path": str(target_dir)}
    save_medusa_checkpoint(out_dir, config, state, format=fmt)
    return ref, out_dir


def load(head_dir, target_dir) -> MedusaHeads:
    return load_medusa_heads(head_dir, target_dir, dtype=torch.float32)


def features(n=5, d=64, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("layers", [1, 2])
def test_public_checkpoint_with_own_lm_heads_equals_reference(target, tmp_path, fmt, layers):
    ref, head_dir = write_reference(tmp_path / "h", target, layers=layers, fmt=fmt)
    heads = load(head_dir, target)
    assert heads.lm_heads is not None and heads.num_heads == 3
    x = features()
    out = heads.logits(x)
    assert out.shape == (5, 3, heads.config.vocab_size) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target_name", ["target", "untied_target"])
def test_public_checkpoint_sharing_the_target_lm_head_equals_reference(request, tmp_path, target_name):
    target_dir = request.getfixturevalue(target_name)
    ref, head_dir = write_reference(tmp_path / "h", target_dir, shared=True)
    heads = load(head_dir, target_dir)
    assert heads.lm_heads is None and heads.shared_lm_head is not None
    x = features()
    torch.testing.assert_close(heads.logits(x), ref(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_logits_of_the_first_heads_only_equal_those_of_all(target, tmp_path, shared, rows):
    ref, head_dir = write_reference(tmp_path / "h", target, shared=shared)
    heads, x = load(head_dir, target), features(n=rows)
    expected = ref(x).detach()
    for n in (1, 2):
        out = heads.logits(x, num_heads=n)
        assert out.shape == (rows, n, heads.config.vocab_size)
        torch.testing.assert_close(out, expected[:, :n], atol=1e-5, rtol=1e-5)


def test_medusa1_legacy_file_without_key_prefix_loads(target, tmp_path):
    ref, head_dir = write_reference(tmp_path / "h", target)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    torch.save(ref.medusa_head.state_dict(), legacy / "medusa_lm_head.pt")  # keys "0.0.linear.weight", ...
    x = features()
    torch.testing.assert_close(load(legacy, target).logits(x), ref(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("own_lm_head", [True, False])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_save_load_round_trip(target, tmp_path, own_lm_head, fmt):
    first = load(random_medusa_checkpoint(tmp_path / "a", target, 4, 7, own_lm_head=own_lm_head), target)
    again = load(save_medusa_heads(tmp_path / "b", first, format=fmt), target)
    assert again.config == first.config
    assert (again.lm_heads is None) == (not own_lm_head)
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = features()
    torch.testing.assert_close(again.logits(x), first.logits(x), atol=0, rtol=0)
    assert not torch.equal(first.logits(x)[:, 0], first.logits(x)[:, 1])  # the heads differ


def test_bfloat16_heads_follow_fp32(target, tmp_path):
    head_dir = random_medusa_checkpoint(tmp_path / "h", target, 2, 0)
    x = features()
    full = load(head_dir, target).logits(x)
    half = load_medusa_heads(head_dir, target, dtype=torch.bfloat16).logits(x)
    assert half.dtype == torch.float32
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s, c: s.pop("medusa_head.1.0.linear.bias"), "lacks weight medusa_head.1.0.linear.bias"),
        (lambda s, c: s.update({"medusa_head.0.0.linear.weight": torch.zeros(3, 3)}), "has shape [3, 3]"),
        (lambda s, c: s.pop("medusa_head.2.1.weight"), "lm_head weights for 2 of 3 heads"),
        (lambda s, c: c.update(medusa_num_layers=2), "unexpected weights ['medusa_head.0.1.weight'"),
        (lambda s, c: c.update(medusa_num_heads=2), "unexpected weights ['medusa_head.2.0.linear.bias'"),
        (lambda s, c: c.update(hidden_size=32), "hidden_size 32 does not match the target's 64"),
        (lambda s, c: c.pop("medusa_num_heads"), "lacks medusa_num_heads"),
    ],
)
def test_bad_checkpoints_name_the_problem(target, tmp_path, edit, message):
    ref, head_dir = write_reference(tmp_path / "h", target)
    state, config = ref.state_dict(), json.loads((head_dir / "config.json").read_text())
    edit(state, config)
    save_medusa_checkpoint(head_dir, config, state)
    with pytest.raises(InvalidArgument) as e:
        load(head_dir, target)
    assert message in str(e.value)


def test_missing_files_fail(target, tmp_path):
    with pytest.raises(InvalidArgument, match="no config.json"):
        load(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    with pytest.raises(InvalidArgument, match="has none of"):
        load(tmp_path, target)


# -- the engine, with a hand-made head --------------------------------------------------------

D, V, H = 4, 16, 3
# RANKS[f][i]: head i's three most likely tokens, best first, for the feature one-hot at f.
RANKS = {
    0: ([5, 7, 9], [11, 3, 8], [1, 4, 6]),
    1: ([2, 12, 13], [14, 5, 0], [10, 9, 15]),
}


def hand_made_head() -> MedusaHeads:
    """Residual blocks of zeros (x + silu(0) = x); lm_head column f of head i scores RANKS[f][i]
    3, 2, 1 and every other token -0.01 * id, so every rank is known."""
    lm_heads = -0.01 * torch.arange(V, dtype=torch.float32).repeat(H, D, 1)  # [H, D, V]
    for f, heads in RANKS.items():
        for i, ranked in enumerate(heads):
            for score, token in zip((3.0, 2.0, 1.0), ranked):
                lm_heads[i, f, token] = score
    config = MedusaConfig(num_heads=H, num_layers=1, hidden_size=D, vocab_size=V)
    return MedusaHeads(config, torch.zeros(H, 1, D, D), torch.zeros(H, 1, D), lm_heads)


class Rig:
    """The engine with a real DraftPeer that is never started: hidden states are fed by hand."""

    def __init__(self, **config):
        self.peer = DraftPeer("127.0.0.1:1")
        self.peer._receive(HiddenStep(0, ()))  # the target's hello: connected
        self.sent = queue.Queue()
        self.peer._outgoing = (self.sent, None)  # (the stream's queue, its columns)
        config = DraftConfig(method="medusa", model_dir=Path("hand-made"), target_model_dir=Path("none"), **config)
        self.engine = MedusaDraftEngine(config, hand_made_head(), self.peer)
        self.step = self.draft_step = 0

    def hidden(self, seq_id: int, feature: int, pending: int, start: int = 10):
        """One target step that streams two pairs of seq_id, the last one (one-hot `feature`, `pending`)."""
        self.step += 1
        rows = torch.zeros(2, D)
        rows[0, (feature + 1) % D] = 1.0
        rows[1, feature] = 1.0
        self.peer._receive(HiddenStep(self.step, (HiddenPairs(seq_id, start, (99 % V, pending), rows),)))

    def draft(self, seqs=(), ops=()):
        self.draft_step += 1
        request = DraftRequest(self.draft_step, self.step, tuple(ops), tuple(DraftSeq(s, k) for s, k in seqs))
        result = self.engine.draft(request)
        assert result.tokens.keys() == result.parents.keys() == {s for s, _ in seqs}
        return {s: (result.tokens[s], result.parents[s]) for s, _ in seqs}


def test_small_static_tree_literal_for_two_sequences_in_one_forward():
    rig = Rig(shape="tree")
    rig.draft(ops=[AddSequence(1, GREEDY), AddSequence(2, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    rig.hidden(2, feature=1, pending=6)
    calls = []
    logits = rig.engine.head.logits
    rig.engine.head.logits = lambda x, heads: calls.append((x.shape[0], heads)) or logits(x, heads)
    out = rig.draft([(1, 4), (2, 4)])
    assert calls == [(2, 3)]  # one batched forward of every head
    # SMALL_STATIC_TREE without its depth-4 node (3 heads): (0,) (1,) (2,) (0,0) (0,1) (1,0)
    # (0,0,0) (0,0,1) (0,1,0); a depth-d choice ending in rank r takes RANKS[f][d - 1][r].
    parents = (0, 0, 0, 1, 1, 2, 4, 4, 5)
    assert out[1] == ((5, 7, 9, 11, 3, 11, 1, 4, 1), parents)
    assert out[2] == ((2, 12, 13, 14, 5, 14, 10, 9, 10), parents)
    assert rig.engine.max_draft_tokens == 9 and rig.engine.shape == "tree"


@pytest.mark.parametrize(
    "num_tokens, expected",
    [
        (1, ((5, 7, 9), (0, 0, 0))),
        (2, ((5, 7, 9, 11, 3, 11), (0, 0, 0, 1, 1, 2))),
        (3, ((5, 7, 9, 11, 3, 11, 1, 4, 1), (0, 0, 0, 1, 1, 2, 4, 4, 5))),
        (8, ((5, 7, 9, 11, 3, 11, 1, 4, 1), (0, 0, 0, 1, 1, 2, 4, 4, 5))),  # no deeper than the heads
        (0, ((), ())),
    ],
)
def test_tree_pruned_by_num_tokens(num_tokens, expected):
    rig = Rig(shape="tree")
    rig.draft(ops=[AddSequence(1, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    assert rig.draft([(1, num_tokens)])[1] == expected


def test_heads_run_only_as_deep_as_the_deepest_tree_asked():
    rig = Rig(shape="tree")
    rig.draft(ops=[AddSequence(1, GREEDY), AddSequence(2, GREEDY)])
    calls = []
    logits = rig.engine.head.logits
    rig.engine.head.logits = lambda x, heads: calls.append(heads) or logits(x, heads)
    for depths in ((1, 1), (1, 2), (2, 8)):
        rig.hidden(1, feature=0, pending=4)
        rig.hidden(2, feature=1, pending=6)
        out = rig.draft([(1, depths[0]), (2, depths[1])])
        assert out[1][0] == ((5, 7, 9), (5, 7, 9), (5, 7, 9, 11, 3, 11))[len(calls) - 1]  # its own depth
    assert calls == [1, 2, 3]


def test_chain_comes_with_parents_and_is_pruned():
    rig = Rig(shape="chain")
    assert rig.engine.max_draft_tokens == H and rig.engine.shape == "chain"
    rig.draft(ops=[AddSequence(1, GREEDY), AddSequence(2, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    rig.hidden(2, feature=1, pending=6)
    assert rig.draft([(1, 5), (2, 2)]) == {1: ((5, 11, 1), (0, 1, 2)), 2: ((2, 14), (0, 1))}


def test_choices_from_json_and_from_a_preset():
    rig = Rig(medusa_choices="[[1], [0], [1, 2], [0, 0]]")
    rig.draft(ops=[AddSequence(1, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    # sorted: (0,) (1,) (0,0) (1,2) -> tokens 5, 7, 11, 8; parents 0, 0, 1, 2
    assert rig.draft([(1, 4)])[1] == ((5, 7, 11, 8), (0, 0, 1, 2))
    assert rig.engine.topk == 3 and rig.engine.shape == "tree"
    config = DraftConfig(method="medusa", model_dir=None, target_model_dir=None, medusa_choices="medusa_chain_4")
    assert medusa_choices(config, 4) == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert medusa_choices(config, 2) == ((0,), (0, 0))  # deeper than the heads: dropped
    tree = DraftConfig(method="medusa", model_dir=None, target_model_dir=None, shape="tree")
    assert medusa_choices(tree, 4) == SMALL_STATIC_TREE


def test_a_head_folders_own_tree_is_its_default(tmp_path):
    (tmp_path / CHOICES_FILE).write_text("[[0], [0, 0], [1], [0, 0, 0], [0, 1]]")
    tree = DraftConfig(method="medusa", model_dir=tmp_path, target_model_dir=None, shape="tree")
    assert medusa_choices(tree, 3) == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert medusa_choices(tree, 2) == ((0,), (1,), (0, 0), (0, 1))
    named = DraftConfig(method="medusa", model_dir=tmp_path, target_model_dir=None, shape="tree", medusa_choices="[[0]]")
    assert medusa_choices(named, 3) == ((0,),)  # --medusa-choices wins
    chain = DraftConfig(method="medusa", model_dir=tmp_path, target_model_dir=None, shape="chain")
    assert medusa_choices(chain, 2) == ((0,), (0, 0))
    small = DraftConfig(method="medusa", model_dir=tmp_path, target_model_dir=None, shape="tree", tree_node_budget=3)
    assert medusa_choices(small, 3) == ((0,), (1,), (0, 0))  # the first 3 listed (best first)
    assert medusa_choices(small, 1) == ((0,), (1,))  # nodes beyond the heads do not count
    (tmp_path / CHOICES_FILE).write_text("[[0, 0], [0], [1]]")  # a child listed before its parent
    two = DraftConfig(method="medusa", model_dir=tmp_path, target_model_dir=None, shape="tree", tree_node_budget=2)
    assert medusa_choices(two, 3) == ((0,), (1,))  # skipped: the budget keeps a tree
    (tmp_path / CHOICES_FILE).write_text("[[1, 0]]")  # no parent: the folder's tree is checked too
    with pytest.raises(InvalidArgument):
        medusa_choices(tree, 3)


@pytest.mark.parametrize("spec", ["[[0], [1, 0, 0]]", "no_such_tree", "[[0], [-1]]", "[1, 2]", "{", "[]"])
def test_bad_choices_fail(spec):
    config = DraftConfig(method="medusa", model_dir=None, target_model_dir=None, medusa_choices=spec)
    with pytest.raises(InvalidArgument):
        medusa_choices(config, 3)


def test_logit_bias_reorders_the_top_k():
    rig = Rig(shape="chain")
    biased = SamplingParams(temperature=0, logit_bias=((13, 10.0),))
    rig.draft(ops=[AddSequence(1, biased), AddSequence(2, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    rig.hidden(2, feature=0, pending=4)
    assert rig.draft([(1, 3), (2, 3)]) == {1: ((13, 13, 13), (0, 1, 2)), 2: ((5, 11, 1), (0, 1, 2))}


def test_drafts_only_from_a_pair_that_came_since_the_last_draft():
    rig = Rig(shape="chain")
    rig.draft(ops=[AddSequence(1, GREEDY)])
    assert rig.draft([(1, 3)]) == {1: ((), ())}  # no hidden state yet
    rig.hidden(1, feature=0, pending=4)
    assert rig.draft([(1, 0)]) == {1: ((), ())}  # k = 0 keeps the pair for later
    assert rig.draft([(1, 3)])[1] == ((5, 11, 1), (0, 1, 2))
    assert rig.draft([(1, 3)]) == {1: ((), ())}  # no new step: the pair is stale
    rig.hidden(1, feature=1, pending=4)
    rig.hidden(1, feature=0, pending=4)  # two steps: the later pair counts
    assert rig.draft([(1, 3)])[1] == ((5, 11, 1), (0, 1, 2))


def test_pop_fork_remove():
    rig = Rig(shape="chain")
    rig.draft(ops=[AddSequence(1, GREEDY)])
    rig.hidden(1, feature=0, pending=4)
    # a fork settles the parent first: the parent still drafts from its pair; the child has none
    out = rig.draft([(1, 3), (2, 3)], ops=[ForkSequence(2, 1, 11, GREEDY)])
    assert out == {1: ((5, 11, 1), (0, 1, 2)), 2: ((), ())}
    rig.hidden(1, feature=1, pending=4)
    assert rig.draft([(1, 3)], ops=[PopTokens(1, 0)])[1] == ((2, 14, 10), (0, 1, 2))  # pop 0: no change
    rig.hidden(1, feature=1, pending=4)
    assert rig.draft([(1, 3)], ops=[PopTokens(1, 2)]) == {1: ((), ())}  # its pair's position is gone
    rig.hidden(2, feature=1, pending=4)
    assert rig.draft([(2, 1)], ops=[RemoveSequence(1)]) == {2: ((2,), (0,))}
    assert rig.engine.stats().sequences_live == 1
    rig.hidden(2, feature=0, pending=4)
    rig.draft(ops=[RemoveSequence(2)])
    assert not rig.peer._pending and rig.engine.stats().sequences_live == 0


def test_op_errors_and_capacity():
    rig = Rig(max_num_sequence=2)
    rig.draft(ops=[AddSequence(1, GREEDY)])
    with pytest.raises(FailedPrecondition):
        rig.draft(ops=[AddSequence(1, GREEDY)])
    for op in (RemoveSequence(7), PopTokens(7, 1), ForkSequence(3, 7, 0, GREEDY)):
        with pytest.raises(NotFound):
            rig.draft(ops=[op])
    with pytest.raises(InvalidArgument):
        rig.draft([(7, 3)])
    rig.draft(ops=[ForkSequence(2, 1, 0, GREEDY)])
    with pytest.raises(ResourceExhausted):
        rig.draft(ops=[AddSequence(3, GREEDY)])
    assert rig.engine.reset().sequences_live == 0


def test_sampled_request_gets_the_same_tree_and_no_probabilities_are_sent():
    rig = Rig(shape="tree")
    rig.draft(ops=[AddSequence(1, SamplingParams(temperature=0.8, top_p=0.5, seed=1))])
    rig.hidden(1, feature=0, pending=4)
    assert rig.draft([(1, 1)])[1] == ((5, 7, 9), (0, 0, 0))  # temperature keeps the top-k order
    assert rig.sent.empty()  # deterministic children: the target verifies without q
