"""Fork and pop in both model services, with EAGLE's one-token lag (request trees, prefix cache).

The engines are driven directly, in process: the target's hidden states are taken from its peer
queue and handed to the draft's peer buffer by hand, so a test can also lose some of them.
"""

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.peer_client import DraftPeer
from tandem.errors import NotFound
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.peer import HiddenStep
from tandem.ops import (
    AddSequence,
    DraftRequest,
    DraftSeq,
    EntryKind,
    ForkSequence,
    PopTokens,
    RemoveSequence,
    StepEntry,
    StepRequest,
)
from tandem.sampling.params import SamplingParams
from tandem.testing.drafts import load_draft_head
from tandem.testing.tiny import build_tiny_model
from target_service.config import TargetConfig
from target_service.engine import TargetEngine

GREEDY = SamplingParams(temperature=0)
PROMPT = tuple(range(20, 31))  # L = 11 tokens: two and a bit pages of 4
L = len(PROMPT)
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def head(model_dir, tmp_path_factory):
    return random_eagle_checkpoint(tmp_path_factory.mktemp("heads") / "random", model_dir, seed=3)


class Rig:
    """A target engine and a draft engine joined by hand instead of by the peer stream."""

    def __init__(self, tiny_model, head, draft_tokens=512):
        self.target = TargetEngine(TargetConfig(model_dir=tiny_model, kv_cache_tokens=512, kv_page_size=4))
        self.hidden = self.target.peer.attach()
        self.peer = DraftPeer("127.0.0.1:1")  # never started: steps are fed by `step`
        self.peer._receive(HiddenStep(0, ()))  # the target's hello: connected
        config = DraftConfig(method="eagle", model_dir=head, target_model_dir=tiny_model, kv_cache_tokens=draft_tokens, kv_page_size=4)
        self.draft = DraftEngine(config, load_draft_head("eagle", head, tiny_model, "float32", "cpu"), self.peer)
        self.step_id = self.draft_step_id = 0

    def step(self, ops=(), entries=(), deliver=True):
        """One target step; returns (results by seq_id, hidden pairs by seq_id)."""
        self.step_id += 1
        result = self.target.step(StepRequest(self.step_id, tuple(ops), tuple(entries)))
        hidden = self.hidden.get_nowait()
        if deliver:
            self.peer._receive(hidden)
        return {r.seq_id: r for r in result.results}, {p.seq_id: p for p in hidden.seqs}

    def drafts(self, ops=(), seqs=()):
        self.draft_step_id += 1
        request = DraftRequest(self.draft_step_id, self.step_id, tuple(ops), tuple(DraftSeq(s, K) for s in seqs))
        return self.draft.draft(request).tokens

    def assert_empty(self):
        for engine, total in ((self.target, self.target.config.num_pages), (self.draft, self.draft.allocator.num_pages)):
            assert engine.allocator.num_sequences == 0 and engine.stats().sequences_live == 0
            assert engine.allocator.num_free_pages == total
        assert not self.target._carry and not self.draft._seqs


def prefill(seq_id, tokens, sample=True, emit=True):
    return StepEntry(seq_id, EntryKind.PREFILL, tuple(tokens), sample, emit_hidden=emit)


def decode(seq_id, token):
    return StepEntry(seq_id, EntryKind.DECODE, (token,), True, emit_hidden=True)


def token(results, seq_id):
    return results[seq_id].tokens[0].token_id


@pytest.fixture
def rig(model_dir, head):
    return Rig(model_dir, head)


def n_children(rig, parent, children, reference=9):
    """The n > 1 layout: the parent prefills prompt[:-1] without sampling; each child forks at
    L - 1 and prefills the last prompt token. `reference` prefills the whole prompt alone."""
    rig.step([AddSequence(parent, GREEDY)], [prefill(parent, PROMPT[:-1], sample=False)])
    forks = [ForkSequence(c, parent, L - 1, GREEDY) for c in children]
    return rig.step(
        forks + [AddSequence(reference, GREEDY)],
        [prefill(c, PROMPT[-1:]) for c in children] + [prefill(reference, PROMPT)],
    )


# -- target -----------------------------------------------------------------------------------


def test_target_child_forked_at_full_length_inherits_the_carry(rig):
    rig.step([AddSequence(1, GREEDY)], [prefill(1, PROMPT[:-1], sample=False)])
    parent_carry = rig.target._carry[1].clone()
    results, pairs = rig.step(
        [ForkSequence(2, 1, L - 1, GREEDY), ForkSequence(3, 1, L - 3, GREEDY), AddSequence(9, GREEDY)],
        [prefill(2, PROMPT[-1:]), prefill(3, PROMPT[-3:]), prefill(9, PROMPT)],
    )
    ref = pairs[9]  # positions 0 .. L-1, each with the token one later
    child = pairs[2]
    assert child.start == L - 2
    assert child.tokens == (PROMPT[-1], token(results, 2)) and token(results, 2) == token(results, 9)
    torch.testing.assert_close(child.hidden[0], parent_carry)
    torch.testing.assert_close(child.hidden, ref.hidden[L - 2 :], rtol=1e-5, atol=1e-5)
    # forked short of the parent's length: no carry, its pairs start where its input does
    assert pairs[3].start == L - 3 and pairs[3].tokens == (*PROMPT[-2:], token(results, 3))
    torch.testing.assert_close(pairs[3].hidden, ref.hidden[L - 3 :], rtol=1e-5, atol=1e-5)


def test_target_pop_drops_the_carry(rig):
    rig.step([AddSequence(1, GREEDY)], [prefill(1, PROMPT[:-1], sample=False)])
    assert 1 in rig.target._carry
    results, pairs = rig.step([PopTokens(1, 1), AddSequence(9, GREEDY)], [prefill(1, PROMPT[-2:]), prefill(9, PROMPT)])
    assert 1 not in rig.target._carry
    assert pairs[1].start == L - 2 and pairs[1].tokens == (PROMPT[-1], token(results, 9))
    torch.testing.assert_close(pairs[1].hidden, pairs[9].hidden[L - 2 :], rtol=1e-5, atol=1e-5)
    rig.step([RemoveSequence(1), RemoveSequence(9)])
    rig.assert_empty()


def test_target_child_samples_like_one_sequence_and_reuse_leaks_nothing(rig):
    results, _ = n_children(rig, 1, (2, 3))
    assert token(results, 2) == token(results, 3) == token(results, 9)
    assert results[2].tokens[0].logprob == pytest.approx(results[9].tokens[0].logprob, abs=1e-5)
    last = {s: token(results, s) for s in (2, 9)}
    for _ in range(3):
        results, _ = rig.step([], [decode(s, last[s]) for s in (2, 9)])
        last = {s: token(results, s) for s in (2, 9)}
        assert last[2] == last[9]
    # reuse a recycled sequence: fork the new id from the old one a token short, drop the old
    length = rig.target.allocator.length(2)
    results, _ = rig.step(
        [RemoveSequence(3), ForkSequence(5, 2, length - 1, GREEDY), RemoveSequence(2)],
        [StepEntry(5, EntryKind.PREFILL, (rig.target._tokens[2][-1], last[2]), True, emit_hidden=True),
         decode(9, last[9])],
    )
    assert token(results, 5) == token(results, 9)
    rig.step([RemoveSequence(1), RemoveSequence(5), RemoveSequence(9)])
    rig.assert_empty()


def test_target_info_reports_the_sliding_window(rig):
    assert rig.target.info().sliding_window == (rig.target.model.config.sliding_window or 0)


# -- draft ------------------------------------------------------------------------------------
# As the router sends them, a Draft call's ops precede the target step that applies the same
# ops: the draft has every pair of the sequences they touch up to the step before.


def test_draft_child_forked_at_parent_length_drafts_like_an_unforked_sequence(rig):
    rig.drafts([AddSequence(1, GREEDY)])
    rig.step([AddSequence(1, GREEDY)], [prefill(1, PROMPT[:-1], sample=False)])
    rig.drafts([ForkSequence(2, 1, L - 2, GREEDY), ForkSequence(3, 1, L - 2, GREEDY), AddSequence(9, GREEDY)])
    # settled: the parent absorbed its L - 2 pairs (its carry waits in the target)
    assert [rig.draft.allocator.length(s) for s in (1, 2, 3)] == [L - 2] * 3
    forks = [ForkSequence(c, 1, L - 1, GREEDY) for c in (2, 3)]
    rig.step(forks + [AddSequence(9, GREEDY)], [prefill(2, PROMPT[-1:]), prefill(3, PROMPT[-1:]), prefill(9, PROMPT)])
    tokens = rig.drafts([], [2, 3, 9])
    assert len(tokens[9]) == K and tokens[2] == tokens[3] == tokens[9]
    for s in (2, 3, 9):
        assert rig.draft.allocator.length(s) - rig.draft._seqs[s].speculative == L == rig.target.allocator.length(s)
    removes = [RemoveSequence(s) for s in (1, 2, 3, 9)]
    rig.drafts(removes)
    rig.step(removes)
    rig.assert_empty()


def test_draft_parent_forked_and_drafted_in_one_call_still_drafts(rig):
    adds = [AddSequence(8, GREEDY), AddSequence(9, GREEDY)]
    rig.drafts(adds)
    rig.step(adds, [prefill(8, PROMPT), prefill(9, PROMPT)])
    tokens = rig.drafts([ForkSequence(7, 9, L - 1, GREEDY)], [8, 9])  # 9's pairs absorbed by the fork
    assert len(tokens[8]) == K and tokens[9] == tokens[8]
    assert rig.draft.allocator.length(7) == L - 1


def test_draft_pop_settles_then_pops(rig):
    adds = [AddSequence(8, GREEDY), AddSequence(9, GREEDY)]
    rig.drafts(adds)
    rig.step(adds, [prefill(8, PROMPT), prefill(9, PROMPT)])
    rig.drafts([PopTokens(9, 1)])  # absorbs its L buffered pairs, then pops one
    assert rig.draft.allocator.length(9) == L - 1
    rig.step([PopTokens(9, 1)], [prefill(9, PROMPT[-1:])])
    tokens = rig.drafts([], [8, 9])
    assert len(tokens[8]) == K and tokens[9] == tokens[8]
    assert rig.draft._seqs[9].speculative == K - 1
    rig.drafts([PopTokens(9, 2)])  # its speculative positions go first
    assert rig.draft.allocator.length(9) == L - 2 and rig.draft._seqs[9].speculative == 0
    rig.step([PopTokens(9, 2)], [prefill(9, PROMPT[-2:])])
    assert rig.drafts([], [9])[9] == tokens[8]
    assert rig.draft.allocator.length(9) - rig.draft._seqs[9].speculative == L
    rig.drafts([PopTokens(9, 10 * L)])  # more than it holds (a lagging draft): empties it
    assert rig.draft.allocator.length(9) == 0
    removes = [RemoveSequence(8), RemoveSequence(9)]
    rig.drafts(removes)
    rig.step(removes)
    rig.assert_empty()


def test_draft_fork_beyond_what_it_absorbed_clamps_and_gets_no_drafts(rig):
    rig.drafts([AddSequence(1, GREEDY)])
    # the parent's first chunk never reaches the draft (a stream outage)
    rig.step([AddSequence(1, GREEDY)], [prefill(1, PROMPT[:4], sample=False)], deliver=False)
    rig.step([], [prefill(1, PROMPT[4:-1], sample=False)])
    rig.drafts([ForkSequence(2, 1, L - 2, GREEDY)])
    assert rig.draft.allocator.length(1) == rig.draft.allocator.length(2) == 0
    results, _ = rig.step([ForkSequence(2, 1, L - 1, GREEDY)], [prefill(2, PROMPT[-1:])])
    assert rig.drafts([], [2]) == {2: ()}
    rig.step([], [decode(2, token(results, 2))])
    assert rig.drafts([], [2]) == {2: ()}  # its pairs never line up again
    removes = [RemoveSequence(2), RemoveSequence(1)]
    rig.drafts(removes)
    rig.step(removes)
    rig.assert_empty()


def test_draft_fork_checks_before_it_changes_anything(rig):
    rig.drafts([AddSequence(1, GREEDY)])
    rig.step([AddSequence(1, GREEDY)], [prefill(1, PROMPT)])
    with pytest.raises(NotFound, match="unknown sequence 404"):
        rig.drafts([ForkSequence(2, 404, 0, GREEDY)])
    assert 2 not in rig.draft._seqs and rig.draft.allocator.num_sequences == 1
    rig.drafts([RemoveSequence(1)])
    rig.step([RemoveSequence(1)])
    rig.assert_empty()


def test_a_full_draft_cache_drops_drafting_for_some_sequences_not_the_call(tiny_model, head):
    """A draft KV of 256 tokens: two 100-token sequences fit, a third does not; it gets no
    drafts, the others draft, nothing raises."""
    rig = Rig(tiny_model, head, draft_tokens=256)
    prompts = {1: list(range(5, 105)), 2: list(range(105, 205)), 3: [7] * 100}
    ops = [AddSequence(s, SamplingParams(temperature=0.0)) for s in prompts]
    rig.step(ops, [prefill(s, p) for s, p in prompts.items()])
    drafted = rig.drafts(ops, seqs=[1, 2, 3])
    assert drafted[1] and drafted[2] and drafted[3] == ()
    assert rig.draft.allocator.num_free_pages >= 0
    removes = [RemoveSequence(s) for s in prompts]
    rig.step(removes)
    rig.drafts(removes)
    rig.assert_empty()
