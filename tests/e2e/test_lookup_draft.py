"""`tandem up --draft ngram` on the default model: the router drafts by prompt lookup (no draft
service, no head) and a model asked to repeat text accepts its drafts."""

from tandem.v1 import generate_pb2 as pb
from tests.e2e.faults import Up

# Text that repeats: the model continues the pattern, which lookup finds in the prompt.
PROMPT = "def f(a, b):\n    return a + b\n\n\ndef g(a, b):\n    return a + b\n\n\ndef h(a, b):\n"


def test_up_with_ngram_drafts_in_the_router_and_accepts_on_repeated_text(default_model):
    up = Up(default_model, "--draft", "ngram", "--spec-draft-length", "4", "--spec-disable-batch-size", "0")
    try:
        up.wait_ready(300)
        assert any("draft: ngram in the router" in line for line in up.lines), up.output()[-2000:]
        assert not any("tandem up: draft started" in line for line in up.lines)  # no draft service
        params = pb.SamplingParams(temperature=0, max_tokens=48)
        responses = list(up.stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=params), timeout=300))
        text = "".join(c.text for r in responses for c in r.choices)
        usage = responses[-1].usage
        assert usage.draft_tokens > 0, text
        assert usage.accepted_draft_tokens > 0, (text, usage)
        assert up.router_stats().draft_tokens_total == usage.draft_tokens
    finally:
        assert up.stop() == 0, up.output()[-3000:]
