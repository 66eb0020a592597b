"""Position-keyed draws (tandem/sampling/keyed.py): the hash, the draw's distribution, and
verification of keyed sequences (chains and trees) emitting exactly plain decoding's tokens."""

import random

import pytest
import torch

from tandem.sampling.keyed import _mix, _mix_int, _signed, _uniforms, keyed_draw, row_key
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import sample
from tandem.sampling.state import SamplingState
from tandem.sampling.tree_verify import verify_tree
from tandem.sampling.verify import verify_chain
from tandem.spec.token_tree import TokenTree
from tests.unit.test_verify import assert_distributed_as

V = 50
KEYED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, keyed_draws=True)
UNFILTERED = SamplingParams(temperature=0.9, seed=1234, keyed_draws=True)


def state(params=KEYED) -> SamplingState:
    return SamplingState(params, V)


def test_the_tensor_hash_is_splitmix64():
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15] + [random.Random(3).getrandbits(64) for _ in range(50)]
    got = _mix(torch.tensor([_signed(v) for v in values], dtype=torch.int64)).tolist()
    assert got == [_signed(_mix_int(v)) for v in values]


def keyed_uniforms(seed: int, index: int, vocab_size: int) -> torch.Tensor:
    return _uniforms(torch.tensor([row_key(seed, index)]), vocab_size)[0]


def test_uniforms_are_in_the_open_interval_and_differ_by_index_and_seed():
    u = keyed_uniforms(5, 0, 10_000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    ks = float((torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u) - u.sort().values).abs().max())
    assert ks < 1.95 / len(u) ** 0.5  # Kolmogorov-Smirnov at the 0.001 level
    assert not torch.equal(u, keyed_uniforms(5, 1, 10_000)) and not torch.equal(u, keyed_uniforms(6, 0, 10_000))


def test_keyed_draws_follow_the_distribution_and_never_draw_zeros():
    p = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    logits, support = (p.log() + 3.0)[None], (p > 0)[None]  # any constant: log p up to one
    draws = [int(keyed_draw(logits, support, [seed], [index])[0]) for seed in range(4) for index in range(2500)]
    assert_distributed_as(torch.bincount(torch.tensor(draws), minlength=5).float(), p)


def test_rows_drawn_together_equal_rows_drawn_alone():
    logits = torch.randn(3, V)
    support = torch.ones(3, V, dtype=torch.bool)
    together = keyed_draw(logits, support, [1, 2, 3], [10, 10, 11]).tolist()
    assert together == [int(keyed_draw(logits[i : i + 1], support[:1], [s], [j])[0])
                        for i, (s, j) in enumerate([(1, 10), (2, 10), (3, 11)])]


def test_a_keyed_row_draws_the_same_in_any_batch_and_leaves_the_stream_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    keyed = state(UNFILTERED)  # alone: the plain softmax; beside a top-p row: the sorted path
    before = keyed.generator.get_state()
    other = SamplingState(SamplingParams(temperature=1.0, top_p=0.5, seed=5), V)  # filters: the batch's slow path
    batch = sample(logits, [other, keyed, state(SamplingParams(temperature=0))], indices=[9, 17, 3])
    alone = sample(logits[1:2], [keyed], indices=[17])
    assert batch.token_ids[1] == alone.token_ids[0]
    assert torch.equal(keyed.generator.get_state(), before)


def plain_decode(rows: torch.Tensor, first_index: int, params=KEYED) -> list[int]:
    """What the target alone emits for rows scored one by one (each row taken as given)."""
    s = state(params)
    out = []
    for j in range(rows.shape[0]):
        out.append(sample(rows[j : j + 1], [s], indices=[first_index + j]).token_ids[0])
        s.observe_output(out[-1])
    return out


@pytest.mark.parametrize("params", [KEYED, SamplingParams(temperature=1.2, frequency_penalty=1.0, seed=9, keyed_draws=True)],
                         ids=["filters", "penalties"])
def test_a_keyed_chain_emits_plain_decodings_tokens_whatever_the_drafts(params):
    torch.manual_seed(1)
    for trial in range(30):
        rows = torch.randn(5, V) * 2
        expected = plain_decode(rows, 40 + trial, params)
        rng = random.Random(trial)
        cut = rng.randint(0, 4)  # drafts right up to `cut`, then a wrong one (if any are left)
        drafts = expected[:cut] + [(expected[cut] + 1) % V] * (cut < 4)
        drafts += [rng.randrange(V) for _ in range(4 - len(drafts))]
        result = verify_chain(rows, drafts, None, state(params), first_index=40 + trial)
        assert result.num_accepted >= cut
        assert [t.token_id for t in result.tokens] == expected[: result.num_accepted + 1]


def test_a_keyed_tree_walks_the_path_of_plain_decodings_tokens():
    torch.manual_seed(2)
    for trial in range(20):
        logits = torch.randn(7, V) * 2
        # Node 0 (root), children 1, 2; 1's children 3, 4; 3's child 5; 2's child 6. Rows of one
        # path are what plain decoding would score along it: root, 1, 3, 5.
        path_rows = logits[[0, 1, 3, 5]]
        expected = plain_decode(path_rows, 100 + trial)
        wrong = (expected[0] + 1) % V
        tokens = (0, expected[0], wrong, expected[1], (expected[1] + 1) % V, expected[2], 5)
        tree = TokenTree((-1, 0, 0, 1, 1, 3, 2), tokens)
        result = verify_tree(logits, tree, None, state(), first_index=100 + trial)
        assert result.accepted_nodes == (1, 3, 5)
        assert [t.token_id for t in result.tokens] == expected


def test_unkeyed_seeded_states_still_verify_by_speculative_sampling():
    params = SamplingParams(temperature=1.0, seed=3)  # keyed_draws off: engine tests' own streams
    assert not params.keyed and SamplingParams(temperature=0, seed=3, keyed_draws=True).keyed is False
    rows = torch.randn(3, V)
    before = state(params)
    generator = before.generator.get_state()
    verify_chain(rows, [1, 2], None, before)
    assert not torch.equal(before.generator.get_state(), generator)  # it drew from its stream
