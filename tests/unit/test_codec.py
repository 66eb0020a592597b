"""Round trips of the peer-stream tensors (dense, sparse draft probabilities, bf16) and of
the engine info and sequence ops."""

import pytest
import torch

from tandem import codec, peer_codec
from tandem.errors import InvalidArgument
from tandem.ops import AddSequence, DraftResult, EngineInfo, EntryKind, ForkSequence, StepEntry, StepRequest
from tandem.peer import DraftProbs, HiddenPairs, HiddenStep
from tandem.sampling.params import SamplingParams
from tandem.tensors import tensor_from_pb, tensor_to_pb
from tandem.v1 import engine_pb2


def test_tensor_round_trip_keeps_dtype_and_bits():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for x in (torch.randn(3, 7).to(dtype), torch.zeros(0, 7, dtype=dtype)):
            y = tensor_from_pb(tensor_to_pb(x))
            assert y.dtype == dtype and torch.equal(x, y)


def test_draft_probs_sparse_when_truncated_dense_otherwise():
    truncated = torch.zeros(2, 1000)
    truncated[0, [3, 9]] = torch.tensor([0.25, 0.75])
    truncated[1, 500] = 1.0
    full = torch.softmax(torch.randn(2, 1000), -1)
    message = peer_codec.draft_probs_to_pb(DraftProbs(4, {1: truncated, 2: full}))
    by_seq = {s.seq_id: s for s in message.seqs}
    assert not by_seq[1].HasField("probs") and list(by_seq[1].flat_index.shape) == [3]
    assert by_seq[1].flat_index.dtype == "int32"  # packed bytes, not one varint per entry
    assert by_seq[2].HasField("probs")
    back = peer_codec.draft_probs_from_pb(message)
    assert back.draft_step_id == 4
    assert torch.equal(back.probs[1], truncated) and torch.equal(back.probs[2], full)
    assert message.ByteSize() < 2 * 1000 * 4 + 200  # the sparse row costs bytes, not a vocabulary


def test_a_trees_rows_travel_in_fp16_without_its_leaves():
    """A drawn tree's [N, V] rows: zero rows for leaves are not sent, the others as fp16 bits."""
    rows = torch.zeros(5, 1000, dtype=torch.float16)
    rows[[0, 2]] = torch.softmax(torch.randn(2, 1000), -1).half()
    message = peer_codec.draft_probs_to_pb(DraftProbs(3, {7: rows}))
    (seq,) = message.seqs
    assert list(seq.rows) == [0, 2] and list(seq.shape) == [5, 1000] and seq.probs.dtype == "float16"
    assert message.ByteSize() < 2 * 1000 * 2 + 200  # two fp16 rows
    back = peer_codec.draft_probs_from_pb(message).probs[7]
    assert back.dtype == torch.float16 and torch.equal(back, rows)
    full = torch.softmax(torch.randn(3, 1000), -1).half()  # a chain's rows: every row kept, dense
    message = peer_codec.draft_probs_to_pb(DraftProbs(4, {1: full}))
    assert not message.seqs[0].rows and torch.equal(peer_codec.draft_probs_from_pb(message).probs[1], full)


def test_rows_a_third_full_travel_as_rows_not_as_indexed_entries():
    """A pruned draft vocabulary fills a third of each expanded row: indexed entries would cost
    as many bytes as the rows, and a pass over the whole tensor to build the index."""
    rows = torch.zeros(5, 999, dtype=torch.float16)
    rows[:3, ::3] = 0.001
    message = peer_codec.draft_probs_to_pb(DraftProbs(2, {1: rows}))
    assert list(message.seqs[0].rows) == [0, 1, 2] and not message.seqs[0].HasField("values")
    assert torch.equal(peer_codec.draft_probs_from_pb(message).probs[1], rows)
    rows[:3, 3:] = 0  # one entry a row: indexed
    assert peer_codec.draft_probs_to_pb(DraftProbs(2, {1: rows})).seqs[0].HasField("values")


def test_rows_on_a_pruned_vocabulary_travel_as_its_columns_only():
    """With the stream's columns, a row's entries in them only (a third of the bytes here); a
    row with mass outside them goes whole; the target needs the columns to rebuild them."""
    columns = torch.arange(2, 999, 3)
    rows = torch.zeros(4, 999, dtype=torch.float16)
    rows[0, columns] = 0.003
    rows[3, columns[:5]] = 0.2
    message = peer_codec.draft_probs_to_pb(DraftProbs(2, {1: rows}), columns)
    sent = message.seqs[0]
    assert sent.on_columns and list(sent.rows) == [0, 3] and list(sent.probs.shape) == [2, len(columns)]
    back = peer_codec.draft_probs_from_pb(message, columns=peer_codec.columns_from_pb(peer_codec.columns_to_pb(columns)))
    assert torch.equal(back.probs[1], rows)
    with pytest.raises(InvalidArgument, match="never sent"):
        peer_codec.draft_probs_from_pb(message)
    with pytest.raises(InvalidArgument, match="do not fit"):
        peer_codec.draft_probs_from_pb(message, columns=columns[:-1])
    rows[3, 0] = 0.1  # outside the columns
    whole = peer_codec.draft_probs_to_pb(DraftProbs(2, {1: rows}), columns).seqs[0]
    assert not whole.on_columns and torch.equal(peer_codec.draft_probs_from_pb(peer_codec.draft_probs_to_pb(
        DraftProbs(2, {1: rows}), columns), columns=columns).probs[1], rows)


@pytest.mark.parametrize("bad", [torch.tensor([3, 2]), torch.tensor([-1, 4]), torch.tensor([1.0, 2.0]),
                                 torch.tensor([[1, 2]]), torch.tensor([], dtype=torch.int32)])
def test_columns_that_are_not_ascending_token_ids_are_invalid_arguments(bad):
    message = peer_codec.columns_to_pb(torch.tensor([1, 2]))
    message.columns.CopyFrom(tensor_to_pb(bad))
    with pytest.raises(InvalidArgument, match="not ascending token ids"):
        peer_codec.columns_from_pb(message)


def test_the_peer_hello_carries_feature_layers_and_columns():
    wire = peer_codec.peer_hello_to_pb((2, 15, 27), torch.tensor([1, 4])).SerializeToString()
    hello = engine_pb2.DraftToTarget.FromString(wire)
    assert peer_codec.feature_layers_from_pb(hello.hello, 30) == (2, 15, 27)
    assert torch.equal(peer_codec.columns_from_pb(hello), torch.tensor([1, 4])) and not hello.seqs
    plain = peer_codec.peer_hello_to_pb(())
    assert plain.HasField("hello") and not plain.HasField("columns") and peer_codec.feature_layers_from_pb(plain.hello, 30) == ()
    with pytest.raises(InvalidArgument, match=r"feature layers \[30\] are outside the target's 30 layers"):
        peer_codec.feature_layers_from_pb(peer_codec.peer_hello_to_pb((2, 30)).hello, 30)
    with pytest.raises(InvalidArgument, match="31 of them, the target has 30 layers"):  # each costs a copy a step
        peer_codec.feature_layers_from_pb(peer_codec.peer_hello_to_pb((0,) * 31).hello, 30)


def test_proposals_are_checked_before_their_rows_are_allocated():
    """A peer's declared shape is bounded (rows) and must match the receiver's vocabulary; a
    tensor's bytes must match its shape."""
    rows = torch.zeros(3, 50, dtype=torch.float16)
    rows[0] = 0.02
    message = peer_codec.draft_probs_to_pb(DraftProbs(5, {1: rows}))
    assert torch.equal(peer_codec.draft_probs_from_pb(message, vocab_size=50).probs[1], rows)
    with pytest.raises(InvalidArgument, match="want"):
        peer_codec.draft_probs_from_pb(message, vocab_size=49)
    message.seqs[0].shape[:] = [10**13, 50]
    with pytest.raises(InvalidArgument, match="want"):
        peer_codec.draft_probs_from_pb(message)
    dense = peer_codec.draft_probs_to_pb(DraftProbs(5, {1: torch.full((2, 50), 0.02)}))
    assert not dense.seqs[0].rows and peer_codec.draft_probs_from_pb(dense, vocab_size=50).probs[1].shape == (2, 50)
    with pytest.raises(InvalidArgument, match="want"):
        peer_codec.draft_probs_from_pb(dense, vocab_size=49)
    odd = tensor_to_pb(torch.zeros(2, dtype=torch.float16))
    odd.data = odd.data[:3]
    with pytest.raises(InvalidArgument, match="3 bytes"):
        tensor_from_pb(odd)


def test_draft_probs_that_do_not_fit_their_shape_are_invalid_arguments():
    rows = torch.zeros(4, 100)
    rows[1] = 0.01
    message = peer_codec.draft_probs_to_pb(DraftProbs(3, {7: rows}))
    message.seqs[0].rows[0] = 9  # past the 4 rows
    with pytest.raises(InvalidArgument, match="do not fit"):
        peer_codec.draft_probs_from_pb(message)
    sparse = torch.zeros(4, 100)
    sparse[0, 5] = 1.0
    message = peer_codec.draft_probs_to_pb(DraftProbs(3, {7: sparse}))
    for index in ([400], [1, 2], [0.5]):  # past the 400 entries; two indices for one value; not an index
        message.seqs[0].flat_index.CopyFrom(tensor_to_pb(torch.tensor(index)))
        with pytest.raises(InvalidArgument, match="do not fit"):
            peer_codec.draft_probs_from_pb(message)


def test_hidden_step_round_trip():
    step = HiddenStep(7, (HiddenPairs(3, 10, (5, 6), torch.randn(2, 8)),))
    back = peer_codec.hidden_step_from_pb(peer_codec.hidden_step_to_pb(step))
    assert back.step_id == 7 and back.seqs[0].start == 10 and back.seqs[0].tokens == (5, 6)
    assert torch.equal(back.seqs[0].hidden, step.seqs[0].hidden)


def test_engine_info_round_trip_keeps_the_sliding_window():
    info = EngineInfo("m", "llama", 64, 512, 16, 100, 8, "float32", 64, sliding_window=4096)
    assert codec.info_from_pb(codec.info_to_pb(info)) == info
    assert EngineInfo("m", "llama", 64, 512, 16, 100, 8, "float32", 64).sliding_window == 0


def test_fork_round_trip_drops_the_router_internal_draft_position():
    fork = ForkSequence(5, 2, 9, SamplingParams(temperature=0), draft_position=8)
    back = codec.op_from_pb(codec.op_to_pb(fork))
    assert back == ForkSequence(5, 2, 9, SamplingParams(temperature=0)) and back.draft_position is None


def test_add_and_fork_carry_the_prompt_length_of_a_resumed_sequence():
    for op in (AddSequence(3, SamplingParams(), num_prompt_tokens=12),
               ForkSequence(5, 2, 9, SamplingParams(), num_prompt_tokens=7)):
        assert codec.op_from_pb(codec.op_to_pb(op)) == op


def test_sampled_trees_round_trip_through_draft_results_and_steps():
    result = DraftResult(9, {1: (4, 5), 2: (6,), 3: ()}, 1.5, {1: (0, 0), 2: (0,)}, frozenset({1}))
    back = codec.draft_result_from_pb(codec.draft_result_to_pb(result))
    assert back.sampled_trees == {1} and back.parents == {1: (0, 0), 2: (0,)} and back.tokens == result.tokens
    entry = StepEntry(1, EntryKind.DECODE, (3, 4, 5), True, 2, True, (0, 0), sampled_tree=True)
    step = codec.step_request_from_pb(codec.step_request_to_pb(StepRequest(2, (), (entry,), draft_step_id=9)))
    assert step.entries == (entry,)


def test_an_unknown_entry_kind_is_an_invalid_argument_naming_it():
    message = codec.step_request_to_pb(StepRequest(2, (), (StepEntry(1, EntryKind.DECODE, (3,), True),)))
    message.entries[0].kind = 7  # a newer router's kind, or garbage
    with pytest.raises(InvalidArgument, match=r"entries\[0\]\.kind = 7"):
        codec.step_request_from_pb(message)


def test_keyed_draws_travel_with_the_sampler():
    params = SamplingParams(temperature=0.5, seed=3, keyed_draws=True)  # exact in float32
    assert codec.sampler_from_pb(codec.sampler_to_pb(params)) == params
    assert not codec.sampler_from_pb(codec.sampler_to_pb(SamplingParams(seed=3))).keyed_draws
