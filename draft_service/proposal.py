"""What every draft engine proposes with."""

from dataclasses import replace

from tandem.errors import ResourceExhausted
from tandem.sampling.state import SamplingState


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
