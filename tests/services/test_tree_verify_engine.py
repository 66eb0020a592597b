"""Tree verification in the real target engine: one forward pass over a token tree (tree
attention), the accepted path's KV kept and compacted, and sampling that stays lossless with
the draft's deterministic (top-k) children and with children it sampled from proposals it sends."""

import pytest
import torch

from tandem.ops import AddSequence, EntryKind, StepEntry, StepRequest
from tandem.peer import DraftProbs
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import draw_without_replacement
from tests.services.test_spec_distribution import (  # noqa: F401 (fixtures)
    N, PROMPT, assert_first_two_follow_the_target, engine, exact, hf, prefill_many,
)

GREEDY = SamplingParams(temperature=0.0)


def greedy_continuation(hf, ids, n):
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_tree_accepts_the_right_branch_and_keeps_only_its_kv(engine, hf):
    engine.reset()
    ids = hf[1](PROMPT)["input_ids"]
    truth = greedy_continuation(hf, ids, 6)  # t0 t1 t2 t3 t4 t5
    wrong = [(t + 1) % 400 + 5 for t in truth]
    first = engine.step(StepRequest(1, (AddSequence(1, GREEDY),), (StepEntry(1, EntryKind.PREFILL, tuple(ids), True),)))
    assert first.results[0].tokens[0].token_id == truth[0]
    # Root t0; children: wrong1 (node 1, with a child), t1 (node 2); under t1: t2 (node 3), wrong3 (node 4);
    # under t2: wrong4 (node 5). Accepted: t1, t2; then the target's own t3.
    tokens = (truth[0], wrong[1], truth[1], truth[2], wrong[3], wrong[4], truth[2])
    parents = (0, 0, 2, 2, 3, 1)
    entry = StepEntry(1, EntryKind.DECODE, tokens, True, num_draft_tokens=6, tree_parents=parents)
    result = engine.step(StepRequest(2, (), (entry,))).results[0]
    assert result.num_accepted == 2
    assert [t.token_id for t in result.tokens] == truth[1:4]
    assert engine.allocator.length(1) == len(ids) + 3  # t0, t1, t2 kept; the rest dropped
    # The next step continues exactly as plain decoding would: the kept KV is the path's.
    nxt = engine.step(StepRequest(3, (), (StepEntry(1, EntryKind.DECODE, (truth[3],), True),))).results[0]
    assert nxt.tokens[0].token_id == truth[4]
    engine.reset()
    assert engine.stats().kv_pages_free == engine.stats().kv_pages_total


def test_bad_trees_are_refused_before_anything_changes(engine):
    from tandem.errors import InvalidArgument

    engine.reset()
    engine.step(StepRequest(1, (AddSequence(1, GREEDY),), (StepEntry(1, EntryKind.PREFILL, (5, 6, 7), True),)))
    before = engine.stats()
    for parents, tokens in (((0, 2), (9, 10, 11)), ((0,), (9, 10, 11)), ((0, 0), (9, 10, 10))):
        entry = StepEntry(1, EntryKind.DECODE, tokens, True, num_draft_tokens=len(tokens) - 1, tree_parents=parents)
        with pytest.raises(InvalidArgument):
            engine.step(StepRequest(2, (), (entry,)))
    assert engine.stats().kv_pages_free == before.kv_pages_free and engine.allocator.length(1) == 3
    engine.reset()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
], ids=["t0.8", "top_p0.9"])
def test_tree_sampling_follows_the_target(engine, hf, params):
    """N sequences verify the same-shaped tree (three top-k children of the root, one
    grandchild): the first two emitted tokens follow the target's own joint distribution."""
    prompt_ids, first = prefill_many(engine, hf, params, seed=7000)
    p1 = {t: exact(hf, prompt_ids, [t], params) for t in set(first.values())}
    trees = {}
    for t in p1:  # deterministic children: the draft's top-2 guesses and an outsider
        top = p1[t].topk(2).indices.tolist()
        children = top + [next(x for x in (7, 11, 13) if x not in top)]
        grandchild = exact(hf, prompt_ids, [t, children[0]], params).argmax().item()
        trees[t] = (tuple(children) + (grandchild,), (0, 0, 0, 1))
    verify = tuple(
        StepEntry(i, EntryKind.DECODE, (first[i],) + trees[first[i]][0], True, num_draft_tokens=4,
                  tree_parents=trees[first[i]][1])
        for i in range(N)
    )
    results = engine.step(StepRequest(2, (), verify)).results
    depth2 = sum(r.num_accepted == 2 for r in results)
    assert 0 < sum(r.num_accepted for r in results) and depth2 > 0  # accepted, recovered and deep paths
    assert_first_two_follow_the_target(hf, prompt_ids, params, first, p1, results)
    engine.reset()
    assert engine.stats().kv_pages_free == engine.stats().kv_pages_total


def test_sampled_tree_children_follow_the_target_with_their_proposals(engine, hf, caplog):
    """N sequences verify trees whose children were drawn without replacement from proposals q
    (three children of the root, one grandchild), q sent as the draft sends it (one row per node):
    the first two emitted tokens follow the target's own joint distribution."""
    params = SamplingParams(temperature=1.0, top_k=6)
    prompt_ids, first = prefill_many(engine, hf, params, seed=9000)
    vocab = engine.model.config.vocab_size
    p1 = {t: exact(hf, prompt_ids, [t], params) for t in set(first.values())}

    def proposal(p):  # overlaps the target's likely tokens, not equal to them
        q = torch.zeros(vocab)
        q[p.topk(3).indices] = 0.2
        q[[7, 11]] += 0.2
        return q / q.sum()

    gen = torch.Generator().manual_seed(3)
    verify, q_rows = [], {}
    for i, t in first.items():
        q = torch.zeros(5, vocab)
        q[0] = proposal(p1[t])
        children = draw_without_replacement(q[0], 3, gen).tolist()
        q[1] = proposal(exact(hf, prompt_ids, [t, children[0]], params))
        grandchild = draw_without_replacement(q[1], 1, gen).tolist()
        q_rows[i] = q
        verify.append(StepEntry(i, EntryKind.DECODE, (t, *children, *grandchild), True, num_draft_tokens=4,
                                tree_parents=(0, 0, 0, 1), sampled_tree=True))
    engine.peer.put_probs(DraftProbs(draft_step_id=1, probs=q_rows))
    results = engine.step(StepRequest(2, (), tuple(verify), draft_step_id=1)).results
    assert "do not fit" not in caplog.text  # verified with the proposals, not as top-k
    accepted = [r.num_accepted for r in results]
    assert 0 < accepted.count(0) and 0 < accepted.count(1) and 0 < accepted.count(2)
    assert_first_two_follow_the_target(hf, prompt_ids, params, first, p1, results)
    engine.reset()
    assert engine.stats().kv_pages_free == engine.stats().kv_pages_total


def test_proposals_that_do_not_fit_the_tree_fall_back_to_top_k(engine, hf, caplog):
    """A row giving a child no probability (a faulty draft) must not fail the step: that tree is
    verified as deterministic children, which is lossless too; the other sequences keep theirs."""
    engine.reset()
    prompt_ids = hf[1](PROMPT)["input_ids"]
    sampled = SamplingParams(temperature=1.0, seed=4)
    ops = (AddSequence(1, sampled), AddSequence(2, sampled))
    prefill = tuple(StepEntry(s, EntryKind.PREFILL, tuple(prompt_ids), True) for s in (1, 2))
    first = {r.seq_id: r.tokens[0].token_id for r in engine.step(StepRequest(1, ops, prefill)).results}
    vocab = engine.model.config.vocab_size
    good, bad = torch.zeros(3, vocab), torch.zeros(3, vocab)
    good[0, [5, 6]] = 0.5
    bad[0, [5, 9]] = 0.5  # child 6 has no probability
    engine.peer.put_probs(DraftProbs(draft_step_id=1, probs={1: good, 2: bad}))
    verify = tuple(StepEntry(s, EntryKind.DECODE, (first[s], 5, 6), True, num_draft_tokens=2,
                             tree_parents=(0, 0), sampled_tree=True) for s in (1, 2))
    results = engine.step(StepRequest(2, (), verify, draft_step_id=1)).results
    assert [len(r.tokens) for r in results] == [r.num_accepted + 1 for r in results]
    assert "sequence 2 do not fit" in caplog.text and "sequence 1 " not in caplog.text
    engine.reset()
    assert engine.stats().kv_pages_free == engine.stats().kv_pages_total
