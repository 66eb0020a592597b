"""What every draft engine proposes with."""

from dataclasses import replace

from torch import Tensor

from tandem.errors import ResourceExhausted
from tandem.sampling.sampler import draw, probabilities, process_logits, wire_proposal
from tandem.sampling.state import SamplingState
from tandem.structured.drafting import DraftWalk, has_allowed, masked


def proposal_sampler(params, num_live: int, config, vocab_size: int, device) -> SamplingState:
    """The sampling state a new draft sequence proposes with; checks the draft's sequence limit
    first (no side effects). Penalties need a token history the draft does not keep, and any
    proposal keeps verification lossless: the draft samples (or ranks its top-k) from the
    request's tempered, truncated, biased distribution without them, cut further to its own top
    `config.proposal_top_k` tokens (0: not cut)."""
    if num_live >= config.max_num_sequence:
        raise ResourceExhausted(f"draft: max_num_sequence ({config.max_num_sequence}) live")
    top_k = params.top_k
    if config.proposal_top_k and not 0 < top_k <= config.proposal_top_k:
        top_k = config.proposal_top_k
    proposal = replace(params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, top_k=top_k)
    if params.keyed:  # verified against the target's keyed draw: its likeliest token, no proposal sent
        proposal = replace(proposal, temperature=0.0)
    return SamplingState(proposal, vocab_size, device)


def propose(state: SamplingState, logits: Tensor, walk: DraftWalk | None = None) -> tuple[int | None, Tensor | None]:
    """One draft token from a head's logits [V] and, for a sampled request, the proposal q [V]
    it was drawn from (what the target verifies with). A constrained sequence (`walk`) proposes
    from its distribution masked to the grammar and renormalised, so q is the masked one; None
    when the draft vocabulary holds no allowed token (its chain ends)."""
    if walk is not None:
        logits = masked(logits, walk.allowed())
        if not has_allowed(logits):
            return None, None
    processed = process_logits(logits[None], [state])
    if state.params.greedy:
        return int(processed[0].argmax()), None
    q = wire_proposal(probabilities(processed, [state]))
    return int(draw(q, [state.generator])[0]), q[0]
