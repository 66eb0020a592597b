"""The EAGLE draft engine at its limits: the end of the head's rope table, a full KV cache for a
sequence that drafts from a settled pair, keyed (seeded) requests' proposals. Each limit costs
the sequence its drafts, never the Draft call (which would stop speculation for everyone)."""

import copy

import pytest

from draft_service.config import DraftConfig
from draft_service.proposal import proposal_sampler
from tandem.ops import AddSequence, ForkSequence, RemoveSequence
from tandem.sampling.params import SamplingParams
from tests.unit.test_eagle_tree import CPU, GREEDY, Rig, head, head_dir, model_dir, pairs  # noqa: F401 (fixtures)


@pytest.fixture
def short_rope_head(head):
    """The head with a rope table of 12 positions, as a target with a longer context than the
    head's max_position_embeddings would leave it."""
    short = copy.copy(head)
    short.rope_cos, short.rope_sin = head.rope_cos[:12], head.rope_sin[:12]
    return short


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_drafts_stop_at_the_end_of_the_rope_table(short_rope_head, pairs, head_dir, model_dir, shape):
    rig = Rig(short_rope_head, head_dir, model_dir, shape=shape, top_k=1)
    assert rig.engine.max_positions == 12
    rig.feed({1: pairs(1, 10)})  # pairs at positions 0..9
    result = rig.draft({1: 4}, [AddSequence(1, GREEDY)])
    assert len(result.tokens[1]) == 3  # drafts 2 and 3 ran at positions 10 and 11, the last ones
    rig.feed({1: pairs(2, 3, start=10)})  # pairs up to position 12: past the table
    assert rig.draft({1: 4}).tokens[1] == ()  # no drafts, no failed call
    rig.feed({2: pairs(3, 5)})
    later = rig.draft({2: 2}, [AddSequence(2, GREEDY)])
    assert len(later.tokens[2]) == 2  # others draft on


def test_a_settled_sequence_without_room_for_its_drafts_gets_none(head, pairs, head_dir, model_dir):
    """A fork settles its parent (absorbs its pairs) before the parent drafts in the same call;
    its speculative positions need pages like anyone's: without them it drafts nothing."""
    rig = Rig(head, head_dir, model_dir, shape="chain")  # 64 pages of 4 tokens
    rig.feed({1: pairs(1, 40), 3: pairs(3, 212)})
    rig.draft({1: 1, 3: 1}, [AddSequence(1, GREEDY), AddSequence(3, GREEDY)])
    assert rig.engine.allocator.num_free_pages == 1
    rig.feed({1: pairs(5, 1, start=40)})  # the parent's next pair fills its 11th page
    result = rig.draft({1: 5}, [ForkSequence(2, 1, 41, GREEDY)])  # 4 speculative positions: a 12th
    assert result.tokens[1] == () and rig.engine.allocator.length(1) == 41
    rig.draft({}, [RemoveSequence(3)])
    rig.feed({1: pairs(6, 1, start=41)})
    assert len(rig.draft({1: 5}).tokens[1]) == 5  # with room again it drafts on


def test_keyed_requests_propose_their_likeliest_tokens(head_dir, model_dir):
    """A seeded request draws keyed: the target keeps a draft only if it is its own draw, so the
    draft proposes greedily and sends no proposal distribution."""
    config = DraftConfig(method="eagle", model_dir=head_dir, target_model_dir=model_dir, proposal_top_k=64)
    keyed = SamplingParams(temperature=0.8, top_p=0.9, seed=5, keyed_draws=True)
    assert proposal_sampler(keyed, 0, config, 100, CPU).params.greedy
    assert not proposal_sampler(SamplingParams(temperature=0.8, seed=5), 0, config, 100, CPU).params.greedy
