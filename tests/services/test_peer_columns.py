"""Proposal rows over a pruned draft vocabulary on the real peer stream: the draft's DraftPeer
sends its columns once per connection, then each proposal row as its columns' entries only;
the target's reader rebuilds the whole rows. A stream that never sent columns gets its rows
dropped (verified as top-k), and the stream stays up."""

import shutil

import torch

from draft_service.peer_client import DraftPeer
from tandem import peer_codec
from tandem.models.config import ModelConfig
from tandem.models.eagle_io import write_draft_vocab
from tandem.peer import DraftProbs
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import generate_pb2 as pb
from target_service.config import TargetConfig
from target_service.server import start_target
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate, peer_stream, start_services


def _proposal_rows(vocab: int, columns: torch.Tensor) -> torch.Tensor:
    """A sampled tree's [4, vocab] fp16 rows: two expanded nodes over the columns, two leaves."""
    rows = torch.zeros(4, vocab, dtype=torch.float16)
    rows[0, columns] = torch.softmax(torch.randn(len(columns)), 0).half()
    rows[2, columns[::2]] = 0.25
    return rows


def test_a_pruned_vocabulary_travels_as_columns_and_arrives_whole(tiny_model):
    server, _, port, engine, _ = start_target(TargetConfig(model_dir=tiny_model, port=0, kv_cache_tokens=256, kv_page_size=8))
    vocab = engine.info().vocab_size
    columns = torch.arange(1, vocab, 3)  # a third of the vocabulary, ascending
    peer = DraftPeer(f"127.0.0.1:{port}")
    peer.use_columns(columns)
    peer.start()
    try:
        assert peer.wait_connected(30)
        rows = _proposal_rows(vocab, columns)
        peer.send_probs(DraftProbs(1, {4: rows}))
        assert torch.equal(engine.peer.take_probs(1, timeout=10)[4], rows)
        outside = rows.clone()
        outside[2, 0] = 0.5  # mass outside the columns: sent as plain rows, still whole
        peer.send_probs(DraftProbs(2, {4: outside}))
        assert torch.equal(engine.peer.take_probs(2, timeout=10)[4], outside)
        wire = peer_codec.draft_probs_to_pb(DraftProbs(1, {4: rows}), columns)
        assert wire.seqs[0].on_columns and wire.ByteSize() < 2 * len(columns) * 2 + 200
    finally:
        peer.stop()
        server.stop(0)


def test_rows_on_columns_the_stream_never_sent_are_dropped_and_the_stream_stays_up(tiny_model):
    server, _, port, engine, _ = start_target(TargetConfig(model_dir=tiny_model, port=0, kv_cache_tokens=256, kv_page_size=8))
    vocab = engine.info().vocab_size
    columns = torch.arange(0, vocab, 2)
    rows = _proposal_rows(vocab, columns)
    messages = [peer_codec.draft_probs_to_pb(DraftProbs(5, {1: rows}), columns),  # before any columns
                peer_codec.columns_to_pb(columns), peer_codec.draft_probs_to_pb(DraftProbs(6, {1: rows}), columns)]
    try:
        with peer_stream(port, messages):
            assert engine.peer.take_probs(5, timeout=10) == {}
            assert torch.equal(engine.peer.take_probs(6, timeout=10)[1], rows)
    finally:
        server.stop(0)


def test_a_pruned_eagle_tree_sends_its_sampled_proposals_on_columns(tiny_model, trained_head, tmp_path, monkeypatch):
    """Served: a head with a pruned vocabulary sends its columns when its peer stream opens, and
    its sampled trees' rows on them; the target verifies each tree with its whole proposal rows;
    a seeded request repeats itself."""
    head = tmp_path / "pruned"
    shutil.copytree(trained_head, head)
    vocab = ModelConfig.from_folder(tiny_model).vocab_size
    write_draft_vocab(head, torch.arange(0, vocab, 2), vocab)
    received, verified = [], []
    rebuild = peer_codec._columns_from_pb
    monkeypatch.setattr(peer_codec, "_columns_from_pb", lambda *a: received.append(1) or rebuild(*a))
    s = start_services(tiny_model, draft_model=head, router={"spec_draft_length": 3},
                       draft={"shape": "tree", "tree_top_k": 2, "tree_node_budget": 4})
    verify_tree = s.target_engine._verify_tree
    monkeypatch.setattr(s.target_engine, "_verify_tree", lambda e, rows, q, *rest: verified.append(
        q is not None and q.shape == (e.num_draft_tokens + 1, vocab)) or verify_tree(e, rows, q, *rest))
    try:
        params = pb.SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)  # unseeded: proposals
        ids, _, _, last = generate(s.stub, prompt=TINY_PROMPTS[1], params=params)
        assert last.usage.draft_tokens > 0 and received and verified and all(verified)
        params.seed = 5  # keyed: top-k trees, verified without proposals, repeatable
        ids = generate(s.stub, prompt=TINY_PROMPTS[1], params=params)[0]
        assert generate(s.stub, prompt=TINY_PROMPTS[1], params=params)[0] == ids
    finally:
        s.stop()
