"""Conversions of the peer stream between the target and the draft: hidden states, draft
probabilities (dense, on the draft's columns, or sparse), the draft's hello. The tensor half of
tandem.codec: only the model services import it (the router carries no tensor)."""

import torch

from tandem.errors import InvalidArgument
from tandem.peer import DraftProbs, HiddenPairs, HiddenStep
from tandem.tensors import tensor_from_pb, tensor_to_pb
from tandem.v1 import engine_pb2 as pb

# -- the peer stream --------------------------------------------------------------------------


def hidden_step_to_pb(h: HiddenStep) -> pb.TargetToDraft:
    seqs = [
        pb.SeqHidden(seq_id=p.seq_id, start=p.start, tokens=p.tokens, hidden=tensor_to_pb(p.hidden))
        for p in h.seqs
    ]
    return pb.TargetToDraft(step_id=h.step_id, seqs=seqs, trace_context=dict(h.trace_context))


def hidden_step_from_pb(m: pb.TargetToDraft, device="cpu") -> HiddenStep:
    seqs = tuple(
        HiddenPairs(s.seq_id, s.start, tuple(s.tokens), tensor_from_pb(s.hidden, device)) for s in m.seqs
    )
    return HiddenStep(m.step_id, seqs, tuple(m.trace_context.items()))


def draft_probs_to_pb(d: DraftProbs, columns: torch.Tensor | None = None) -> pb.DraftToTarget:
    """columns: the token ids the stream's columns stand for, ascending and unique as the target
    requires (a pruned draft vocabulary, sent first by `columns_to_pb`): rows whose entries all
    lie in them travel as those entries."""
    return pb.DraftToTarget(draft_step_id=d.draft_step_id,
                            seqs=[_probs_to_pb(s, p, columns) for s, p in d.probs.items()])


def columns_to_pb(columns: torch.Tensor) -> pb.DraftToTarget:
    return pb.DraftToTarget(columns=tensor_to_pb(columns.to(torch.int32)))


def peer_hello_to_pb(feature_layers: tuple[int, ...], columns: torch.Tensor | None = None) -> pb.DraftToTarget:
    """The draft's first message on a peer stream: its feature layers, and its columns if any."""
    m = columns_to_pb(columns) if columns is not None else pb.DraftToTarget()
    m.hello.CopyFrom(pb.PeerHello(feature_layers=feature_layers))
    return m


def feature_layers_from_pb(m: pb.PeerHello, num_layers: int) -> tuple[int, ...]:
    """The hello's feature layers; InvalidArgument naming any outside the target's layers."""
    layers = tuple(m.feature_layers)
    if len(layers) > num_layers:  # each costs a [T, D] copy a step: bounded by the model
        raise InvalidArgument(f"draft feature layers: {len(layers)} of them, the target has {num_layers} layers")
    bad = [i for i in layers if i >= num_layers]
    if bad:
        raise InvalidArgument(f"draft feature layers {bad} are outside the target's {num_layers} layers "
                              f"(0..{num_layers - 1}): the head was trained for another model")
    return layers


def columns_from_pb(m: pb.DraftToTarget) -> torch.Tensor:
    """The stream's columns, int64 [C]; InvalidArgument unless ascending token ids."""
    columns = tensor_from_pb(m.columns)
    if (columns.is_floating_point() or columns.dim() != 1 or not len(columns) or int(columns[0]) < 0
            or not bool((columns[1:] > columns[:-1]).all())):
        raise InvalidArgument(f"draft columns: {list(columns.shape)} {m.columns.dtype} entries are not ascending token ids")
    return columns.long()


def _probs_to_pb(seq_id: int, probs, columns: torch.Tensor | None = None) -> pb.SeqDraftProbs:
    """The nonzero entries (sparse) when they take under half the bytes of the nonzero rows
    (a cut proposal; building their index costs a pass of its own), else the nonzero rows on the
    stream's columns when nothing lies outside them (a pruned draft vocabulary), else all rows
    when none is zero (dense), else the nonzero rows (a tree's leaves have none)."""
    per_row = torch.count_nonzero(probs, dim=-1)
    rows = per_row.nonzero().flatten()
    size, nonzero = probs.element_size(), int(per_row.sum())
    on_columns = columns is not None and len(rows) > 0 and len(columns) < probs.shape[1]
    width = len(columns) if on_columns else probs.shape[1]
    if 2 * nonzero * (4 + size) < len(rows) * width * size:
        flat = probs.flatten()
        index = flat.nonzero().flatten()
        small = index.to(torch.int32) if len(flat) <= torch.iinfo(torch.int32).max else index
        return pb.SeqDraftProbs(seq_id=seq_id, shape=list(probs.shape), flat_index=tensor_to_pb(small),
                                values=tensor_to_pb(flat[index]))
    if on_columns:
        kept = probs.index_select(0, rows).index_select(1, columns)
        if int(torch.count_nonzero(kept)) == nonzero:  # nothing outside the columns
            return pb.SeqDraftProbs(seq_id=seq_id, shape=list(probs.shape), rows=rows.tolist(),
                                    probs=tensor_to_pb(kept), on_columns=True)
    if len(rows) == len(probs):
        return pb.SeqDraftProbs(seq_id=seq_id, probs=tensor_to_pb(probs))
    return pb.SeqDraftProbs(seq_id=seq_id, shape=list(probs.shape), rows=rows.tolist(), probs=tensor_to_pb(probs[rows]))


MAX_PROPOSAL_ROWS = 4096  # rows of one sequence's proposal: its draft tokens (+ 1 for a tree)


def _checked_shape(m: pb.SeqDraftProbs, vocab_size: int | None) -> tuple[int, int]:
    """The [k, vocab] a row-sparse, sparse or columns proposal declares, before it is allocated."""
    shape = tuple(m.shape)
    if (len(shape) != 2 or not 0 < shape[0] <= MAX_PROPOSAL_ROWS or shape[1] <= 0
            or (vocab_size is not None and shape[1] != vocab_size)):
        raise InvalidArgument(f"draft probabilities of shape {list(shape)}: want [1..{MAX_PROPOSAL_ROWS},"
                              f" {vocab_size or 'vocab'}]")
    return shape


def _columns_from_pb(m: pb.SeqDraftProbs, device, columns: torch.Tensor | None, vocab_size: int | None):
    if columns is None:
        raise InvalidArgument("draft probabilities on columns the stream never sent")
    shape = _checked_shape(m, vocab_size)
    kept = tensor_from_pb(m.probs, device)
    if (kept.shape != (len(m.rows), len(columns)) or not m.rows
            or max(m.rows) >= shape[0] or int(columns[-1]) >= shape[1]):
        raise InvalidArgument(f"draft probabilities: {len(m.rows)} rows of {len(columns)} columns, shaped"
                              f" {list(kept.shape)}, do not fit {list(m.shape)}")
    dense = torch.zeros(shape, dtype=kept.dtype, device=device)
    rows = torch.tensor(list(m.rows), dtype=torch.int64, device=device)
    dense[rows[:, None], columns.to(device)[None, :]] = kept
    return dense


def draft_probs_from_pb(m: pb.DraftToTarget, device="cpu", columns: torch.Tensor | None = None,
                        vocab_size: int | None = None) -> DraftProbs:
    """columns: the stream's (`columns_from_pb`), for rows sent on them; vocab_size: the
    receiver's, which every layout that allocates its whole rows must match."""
    return DraftProbs(m.draft_step_id, {s.seq_id: _probs_from_pb(s, device, columns, vocab_size) for s in m.seqs})


def _probs_from_pb(m: pb.SeqDraftProbs, device, columns: torch.Tensor | None = None, vocab_size: int | None = None):
    if m.on_columns:
        return _columns_from_pb(m, device, columns, vocab_size)
    if m.HasField("probs") and not m.rows:
        dense = tensor_from_pb(m.probs, device)
        if dense.dim() != 2 or (vocab_size is not None and dense.shape[1] != vocab_size):
            raise InvalidArgument(f"draft probabilities of shape {list(dense.shape)}: want [k, {vocab_size or 'vocab'}]")
        return dense
    if m.HasField("probs"):
        shape = _checked_shape(m, vocab_size)
        kept = tensor_from_pb(m.probs, device)
        if kept.dim() != 2 or kept.shape != (len(m.rows), shape[1]) or max(m.rows) >= shape[0]:
            raise InvalidArgument(f"draft probabilities: {len(m.rows)} rows of shape {list(kept.shape)} do not fit {list(m.shape)}")
        dense = torch.zeros(shape, dtype=kept.dtype, device=device)
        dense[torch.tensor(list(m.rows), dtype=torch.int64, device=device)] = kept
        return dense
    shape = _checked_shape(m, vocab_size)
    values, index = tensor_from_pb(m.values, device), tensor_from_pb(m.flat_index, device)
    dense = torch.zeros(shape, dtype=values.dtype, device=device)
    if (index.is_floating_point() or index.shape != values.shape or values.dim() != 1
            or (len(index) and not 0 <= int(index.min()) <= int(index.max()) < dense.numel())):
        raise InvalidArgument(f"draft probabilities: {list(index.shape)} sparse entries do not fit {list(m.shape)}")
    dense.view(-1)[index.long()] = values
    return dense
