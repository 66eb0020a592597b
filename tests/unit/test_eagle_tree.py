"""EAGLE-2 tree drafting in the draft engine, driven directly: real pairs (random target
features with tokens) are handed to the draft's peer buffer by hand.

The reference for a tree node is a chain-style run of its root-to-node path on a fresh cache:
the real pairs, then one pair (token, previous predicted feature) per path node, each appended
causally. Tree attention is right when every expanded node's predicted feature equals it.
"""

import pytest
import torch

from draft_service import eagle_tree
from draft_service import engine as engine_module
from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.peer_client import DraftPeer
from draft_service.proposal import proposal_sampler
from tandem.attention.torch_backend import TorchAttention
from tandem.kv.batching import TreeInput, append_batch
from tandem.kv.cache import PagedKVCache
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.models.loader import load_model
from tandem.ops import AddSequence, DraftRequest, DraftSeq, PopTokens, RemoveSequence
from tandem.peer import HiddenPairs, HiddenStep
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import probabilities, process_logits, received_proposal
from tandem.sampling.state import SamplingState
from tandem.sampling.tree_verify import fits_sampled_tree
from tandem.spec.token_tree import TokenTree
from tandem.testing.drafts import load_draft_head, random_eagle3_checkpoint
from tandem.testing.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module", params=[1, 2, "eagle3"], ids=["1-layer", "2-layer", "eagle3"])
def head_dir(model_dir, tmp_path_factory, request):
    """Heads of one decoder layer and of two (each tree fork copies and keeps every KV layer),
    and an EAGLE-3 head (it reads three target layers, and its own outputs on draft steps)."""
    out = tmp_path_factory.mktemp("heads") / "random"
    if request.param == "eagle3":
        return random_eagle3_checkpoint(out, model_dir, seed=3, aux_layers=(0, 1))
    return random_eagle_checkpoint(out, model_dir, seed=3, num_layers=request.param)


@pytest.fixture(scope="module")
def head(model_dir, head_dir):
    return load_draft_head("eagle", head_dir, model_dir, "float32", "cpu")


@pytest.fixture
def pairs(head):
    """real_pairs of the width the head reads."""
    return lambda seed, n, start=0: real_pairs(seed, n, start, hidden=head.feature_width)


class Rig:
    """A draft engine whose peer buffer is fed by hand; one target step per `feed`."""

    def __init__(self, head, head_dir, model_dir, *, shape="tree", top_k=3, budget=8):
        self.peer = DraftPeer("127.0.0.1:1")  # never started
        self.peer._receive(HiddenStep(0, ()))  # the target's hello: connected
        config = DraftConfig(
            method="eagle", model_dir=head_dir, target_model_dir=model_dir, kv_cache_tokens=256,
            kv_page_size=4, shape=shape, tree_top_k=top_k, tree_node_budget=budget,
        )
        self.engine = DraftEngine(config, head, self.peer)
        self.step_id = self.draft_step_id = 0

    def feed(self, pairs: dict[int, tuple[int, tuple[int, ...], torch.Tensor]]) -> None:
        """seq_id -> (start, tokens, hidden [n, D]): one target step's hidden states."""
        self.step_id += 1
        self.peer._receive(HiddenStep(self.step_id, tuple(HiddenPairs(s, *p) for s, p in pairs.items())))

    def draft(self, depths: dict[int, int], ops=()):
        self.draft_step_id += 1
        seqs = tuple(DraftSeq(s, k) for s, k in depths.items())
        return self.engine.draft(DraftRequest(self.draft_step_id, self.step_id, tuple(ops), seqs))


def real_pairs(seed: int, n: int, start: int = 0, vocab: int = 300, hidden: int = 64):
    gen = torch.Generator().manual_seed(seed)
    tokens = tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())
    return start, tokens, torch.randn(n, hidden, generator=gen)


def as_tree(root: int, tokens, parents) -> TokenTree:
    return TokenTree(parents=(-1, *parents), tokens=(root, *tokens))


def reference_features(head, prefix_tokens, prefix_hidden, path_tokens) -> torch.Tensor:
    """Predicted features [1 + len(path), D] of the last real pair and of each path node,
    the path run causally after the real pairs, one pair per call as a chain drafts."""
    mc = head.model_config
    cache = PagedKVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                         num_pages=64, page_size=4, dtype=head.dtype)
    cache.allocator.add(1)

    def run(tokens, feats):
        batch, _ = append_batch(cache, head.backend, [(1, tokens)], None, CPU)
        return head.forward(batch.input_ids, feats, batch, cache)[-1]

    out = [run(list(prefix_tokens), prefix_hidden)]
    for token in path_tokens:
        out.append(run([token], out[-1][None]))
    return torch.stack(out)


class LogitsRecorder:
    """Wraps a head: records every feature row whose logits the engine asks for."""

    def __init__(self, head):
        self._head, self.rows = head, []

    def __getattr__(self, name):
        return getattr(self._head, name)

    def scores(self, features):
        self.rows.append(features.clone())
        return self._head.scores(features)

    def logits(self, features):
        return self._head.widen(self.scores(features))


# -- tree attention over a trailing span of cached nodes -----------------------------------------


def test_tree_input_span_reaches_nodes_cached_by_earlier_calls(tmp_path):
    """A tree appended depth by depth (masks [n, span]) equals each node's path run causally."""
    model = load_model(build_tiny_model(tmp_path / "tiny", seed=1), dtype=torch.float32, backend=TorchAttention())
    mc = model.config

    def new_cache():
        cache = PagedKVCache(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                             num_pages=64, page_size=4, dtype=model.dtype)
        cache.allocator.add(1)
        return cache

    def run(cache, tokens, tree=None):
        batch, _ = append_batch(cache, model.backend, [(1, tokens)], None, CPU, {1: tree} if tree else None)
        return model.forward(batch, cache)

    prefix = (5, 6, 7, 8, 9)  # the root is the last prefix token, position 4
    cache = new_cache()
    run(cache, prefix)
    # depth 1: nodes a=21, b=22; depth 2: c=31 under a, d=32 under b, e=33 under a
    out1 = run(cache, (21, 22), TreeInput((1, 1), torch.eye(2, dtype=torch.bool), root_position=4))
    mask2 = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    out2 = run(cache, (31, 32, 33), TreeInput((2, 2, 2), mask2, root_position=4))
    paths = {(21,): out1[0], (22,): out1[1], (21, 31): out2[0], (22, 32): out2[1], (21, 33): out2[2]}
    for path, got in paths.items():
        expected = run(new_cache(), prefix + path)[-1]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- (a) tree attention in the draft ----------------------------------------------------------


@pytest.fixture
def grown(monkeypatch):
    """The DynamicTrees the engine grows, by call: each node's expansion row (dist_rows)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(eagle_tree.grow_trees(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(engine_module, "grow_trees", spy)
    return calls


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_expanded_node_equals_its_path_run_causally(head, pairs, head_dir, model_dir, params, grown):
    recorder = LogitsRecorder(head)
    rig = Rig(recorder, head_dir, model_dir, top_k=3, budget=40)  # keeps every candidate
    first, second = pairs(1, 7), pairs(2, 3, start=7)
    rig.feed({1: first})
    rig.draft({1: 4}, [AddSequence(1, params)])
    rig.feed({1: second})  # the second call pops the first tree and grows on the longer prefix
    recorder.rows.clear()
    result = rig.draft({1: 4})
    dynamic, probs = grown[-1][1].grown, grown[-1][1].probs
    tree = dynamic.tree
    assert (tree.tokens[1:], tree.parents[1:]) == (result.tokens[1], result.parents[1])
    # greedy keeps every candidate; sampled trees keep each depth's frontier of 3
    size = 1 + 3 + 3 * 9 if params.greedy else 1 + 3 * 4
    assert tree.tokens[0] == second[1][-1] and tree.max_depth == 4 and len(tree) == size
    assert (probs is None) == params.greedy
    rows = torch.cat(recorder.rows)  # one sequence: the expansion rows, in order
    assert len(rows) == 1 + 3 * 3  # the root, then top_k frontier nodes at depths 1..3
    prefix_tokens, prefix_hidden = first[1] + second[1], torch.cat([first[2], second[2]])
    state = SamplingState(rig.engine._seqs[1].sampler.params, head.config.vocab_size)  # the proposal's
    for node in range(len(tree)):
        if dynamic.dist_rows[node] < 0:
            continue  # never expanded: never run
        path = [tree.tokens[n] for n in tree.path_to(node)[1:]]
        ref = reference_features(head, prefix_tokens, prefix_hidden, path)[-1]
        torch.testing.assert_close(rows[dynamic.dist_rows[node]], ref, rtol=1e-4, atol=1e-4)
        processed = process_logits(head.logits(ref[None]), [state])
        kids = [tree.tokens[c] for c in tree.children[node]]
        if params.greedy:  # its kept children are among the top-k of that distribution, best first
            top = processed[0].topk(3).indices.tolist()
            assert kids == [t for t in top if t in kids]
        elif kids:  # drawn from the proposal the target gets for this node
            proposal = probabilities(processed, [state])[0]
            assert probs[node].dtype == torch.float16  # rounded, as drawn from and sent
            torch.testing.assert_close(probs[node].float(), proposal, rtol=1e-3, atol=1e-6)
            assert len(set(kids)) == len(kids) and bool((probs[node, kids] > 0).all())
        else:
            assert not probs[node].any()  # a leaf's row is never read


def test_sequences_batched_grow_the_trees_they_grow_alone(head, pairs, head_dir, model_dir):
    """One forward per depth for all sequences: each tree equals the one drafted alone,
    whatever the other sequences' depths (2, 4, 0) and sampling params."""
    params = {1: GREEDY, 2: SAMPLED, 3: GREEDY}
    depths = {1: 2, 2: 4, 3: 0}
    fed = {s: pairs(10 + s, 5 + s) for s in params}
    rig = Rig(head, head_dir, model_dir, top_k=2, budget=100)  # keeps every candidate
    rig.feed(fed)
    together = rig.draft(depths, [AddSequence(s, p) for s, p in params.items()])
    assert together.tokens[3] == () and together.parents[3] == ()
    for s in (1, 2):
        alone = Rig(head, head_dir, model_dir, top_k=2, budget=100)
        alone.feed({s: fed[s]})
        result = alone.draft({s: depths[s]}, [AddSequence(s, params[s])])
        assert result.tokens[s] == together.tokens[s] and result.parents[s] == together.parents[s]
        tree = as_tree(fed[s][1][-1], result.tokens[s], result.parents[s])
        size = 1 + 2 + 4 * (depths[s] - 1) if params[s].greedy else 1 + 2 * depths[s]  # all, or frontiers
        assert tree.max_depth == depths[s] and len(tree) == size


# -- (b) top_k = 1 is the chain ---------------------------------------------------------------


def test_top_1_tree_is_the_greedy_chain(head, pairs, head_dir, model_dir):
    trees = Rig(head, head_dir, model_dir, top_k=1, budget=16)
    chains = Rig(head, head_dir, model_dir, shape="chain")
    adds = [AddSequence(s, GREEDY) for s in (1, 2)]
    for rig in (trees, chains):
        rig.feed({1: pairs(1, 6), 2: pairs(2, 9)})
    tree_result, chain_result = trees.draft({1: 3, 2: 5}, adds), chains.draft({1: 3, 2: 5}, adds)
    assert chain_result.parents is None
    assert tree_result.tokens == chain_result.tokens
    assert tree_result.parents == {1: (0, 1, 2), 2: (0, 1, 2, 3, 4)}
    for rig in (trees, chains):  # a second round: both pop their speculative positions
        rig.feed({1: pairs(3, 2, start=6)})
    tree_result, chain_result = trees.draft({1: 4, 2: 2}), chains.draft({1: 4, 2: 2})
    assert tree_result.tokens == chain_result.tokens and len(tree_result.tokens[1]) == 4
    assert tree_result.tokens[2] == ()  # no new pairs: no drafts, as in a chain


# -- (c) shape limits -------------------------------------------------------------------------


@pytest.mark.parametrize("top_k,budget,depth", [(3, 5, 3), (2, 100, 3), (4, 16, 6), (1, 2, 5)])
def test_budget_depth_topology_and_distinct_siblings(head, pairs, head_dir, model_dir, top_k, budget, depth):
    rig = Rig(head, head_dir, model_dir, top_k=top_k, budget=budget)
    start, tokens, hidden = pairs(7, 9)
    rig.feed({1: (start, tokens, hidden)})
    result = rig.draft({1: depth}, [AddSequence(1, SAMPLED)])
    drafts, parents = result.tokens[1], result.parents[1]
    assert len(drafts) == len(parents) == min(budget, top_k * depth)  # sampled: each depth's frontier
    assert all(0 <= p <= i for i, p in enumerate(parents))  # draft i is node i + 1
    tree = as_tree(tokens[-1], drafts, parents)  # checks topology and distinct siblings
    assert tree.max_depth <= depth
    # every expanded node (top_k per depth but the last) became a speculative position
    assert rig.engine.allocator.length(1) == len(tokens) + top_k * (depth - 1)
    assert rig.engine._seqs[1].speculative == top_k * (depth - 1)


def test_sampled_trees_send_their_proposals_one_row_per_node(head, pairs, head_dir, model_dir, monkeypatch):
    rig = Rig(head, head_dir, model_dir, top_k=3, budget=7)
    sent = []
    monkeypatch.setattr(rig.peer, "send_probs", sent.append)
    rig.feed({1: pairs(1, 5), 2: pairs(2, 6)})
    result = rig.draft({1: 3, 2: 3}, [AddSequence(1, SAMPLED), AddSequence(2, GREEDY)])
    assert result.sampled_trees == {1}
    assert len(sent) == 1 and set(sent[0].probs) == {1}  # greedy trees send nothing
    tree = as_tree(pairs(1, 5)[1][-1], result.tokens[1], result.parents[1])
    q = sent[0].probs[1]
    assert q.shape == (len(tree), head.config.vocab_size) == (8, head.config.vocab_size)
    assert q.dtype == torch.float16  # the rounded rows the draft drew from
    assert fits_sampled_tree(received_proposal(q), tree)  # as the target reads them: every child possible
    assert all(not q[i].any() for i, kids in enumerate(tree.children) if not kids)
    # top-p 0.9 cut the proposal: the rows are sparse, and so is what travels
    assert int((q[0] > 0).sum()) < head.config.vocab_size
    again = Rig(head, head_dir, model_dir, top_k=3, budget=7)  # the same seed draws the same tree
    monkeypatch.setattr(again.peer, "send_probs", lambda m: None)
    again.feed({1: pairs(1, 5)})
    assert again.draft({1: 3}, [AddSequence(1, SAMPLED)]).tokens[1] == result.tokens[1]


def test_the_proposal_is_cut_to_the_drafts_top_k(head_dir, model_dir):
    """proposal_top_k narrows a sampled request's proposal; a narrower request top-k stays."""
    def proposal(params, cut):
        config = DraftConfig(method="eagle", model_dir=head_dir, target_model_dir=model_dir, proposal_top_k=cut)
        return proposal_sampler(params, 0, config, 100, CPU).params

    assert proposal(SAMPLED, 64).top_k == 64 and proposal(SAMPLED, 0).top_k == 0
    assert proposal(SamplingParams(temperature=1, top_k=8), 64).top_k == 8
    assert proposal(SamplingParams(temperature=1, top_k=500), 64).top_k == 64
    penalised = SamplingParams(temperature=1, repetition_penalty=1.3, presence_penalty=0.5)
    assert proposal(penalised, 64).repetition_penalty == 1.0 and proposal(penalised, 64).presence_penalty == 0.0


# -- (d) speculative positions and pages --------------------------------------------------------


def test_speculative_positions_are_popped_and_no_pages_leak(head, pairs, head_dir, model_dir):
    rig = Rig(head, head_dir, model_dir, top_k=3, budget=8)
    engine = rig.engine
    rig.feed({1: pairs(1, 6), 2: pairs(2, 4)})
    rig.draft({1: 3, 2: 2}, [AddSequence(1, GREEDY), AddSequence(2, SAMPLED)])
    assert engine.allocator.length(1) == 6 + 3 * 2 and engine.allocator.length(2) == 4 + 3
    # the next call pops them before it absorbs the new pairs, which continue the real ones
    rig.feed({1: pairs(3, 2, start=6)})
    result = rig.draft({1: 1, 2: 3})
    assert len(result.tokens[1]) == 3 and result.tokens[2] == ()
    assert engine.allocator.length(1) == 8 and engine.allocator.length(2) == 4
    # an ops-only call settles (pops) the sequence a PopTokens names
    rig.draft({1: 2})
    rig.draft({}, [PopTokens(1, 1)])
    assert engine.allocator.length(1) == 7 and engine._seqs[1].speculative == 0
    rig.draft({}, [RemoveSequence(1), RemoveSequence(2)])
    assert engine.allocator.num_free_pages == engine.allocator.num_pages
    assert engine.allocator.num_sequences == 0 and not engine._seqs
