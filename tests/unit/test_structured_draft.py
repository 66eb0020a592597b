"""Constrained drafting: a draft walk over a sequence's grammar (forced tokens, allowed rows,
rollback), the masked proposal and its q, Medusa's constrained tree, the draft's bookkeeping of
a sequence's output, and the EAGLE engine's chains and trees (greedy and sampled) driven
directly: every draft path stays inside the grammar and a forced run is proposed free."""

import json

import pytest
import torch

from draft_service.grammars import DraftGrammars
from draft_service.medusa_engine import constrained_tree
from draft_service.proposal import propose
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.ops import AddSequence
from tandem.sampling.params import SamplingParams
from tandem.sampling.sampler import probabilities, process_logits
from tandem.sampling.state import SamplingState
from tandem.structured.drafting import DraftWalk
from tandem.structured.llguidance_backend import LlguidanceBackend
from tandem.structured.matcher import SequenceGrammar
from tandem.structured.spec import StructuredOutput
from tandem.testing.drafts import load_draft_head
from tandem.testing.tiny import build_tiny_model, build_tokenizer
from tests.unit.test_eagle_tree import Rig

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
CHOICE = StructuredOutput("choice", ("the weather today", "the weather tomorrow", "a cat"))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    return LlguidanceBackend(tok.backend_tokenizer.to_str(), -(-len(tok) // 64) * 64, [EOS])


def walk_of(backend, spec, output=()):
    grammar = SequenceGrammar(backend.new_matcher(backend.compile(spec)), backend.eos_token_ids)
    assert grammar.sync(list(output))
    return DraftWalk(grammar, backend.vocab_size)


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def inside(backend, spec, output, path) -> bool:
    """Whether a fresh matcher after `output` takes every token of `path`."""
    grammar = SequenceGrammar(backend.new_matcher(backend.compile(spec)), backend.eos_token_ids)
    return grammar.sync(list(output)) and all(grammar.accept(t) for t in path)


def test_a_forced_run_is_the_grammars_canonical_tokens_and_the_walk_rolls_back(backend, tok):
    walk = walk_of(backend, JSON_SPEC)
    run = walk.forced(limit=10)
    assert tok.decode(run) == '{"name": "'  # fixed keys, one-line layout: all forced to the value
    assert len(walk.grammar.history) == len(run)
    assert walk.forced(limit=10) == []  # the value is free
    walk.close()
    assert walk.grammar.history == [] and walk.forced(limit=2) == run[:2]


def test_allowed_rows_follow_the_path_and_push_refuses_what_the_grammar_does(backend, tok):
    walk = walk_of(backend, CHOICE)
    first = walk.allowed()
    assert first[ids(tok, "the")[0]] and not first[ids(tok, "cat")[0]]
    assert walk.to(ids(tok, "a"))
    assert tok.decode(walk.forced(limit=5)) == " cat"
    assert walk.stopped  # only EOS may follow
    assert not walk.to(ids(tok, "cat"))  # refused, never fed
    assert walk.to([]) and walk.allowed().sum() > 1


def test_the_proposal_is_the_masked_renormalised_distribution(backend, tok):
    walk = walk_of(backend, CHOICE)
    allowed = walk.allowed()
    logits = torch.randn(backend.vocab_size, generator=torch.Generator().manual_seed(1))
    logits[~allowed] += 50.0  # the raw argmax is outside the grammar
    greedy = SamplingState(SamplingParams(temperature=0), backend.vocab_size, "cpu")
    token, q = propose(greedy, logits, walk)
    assert q is None and allowed[token] and token == int(logits.masked_fill(~allowed, -1e9).argmax())
    params = SamplingParams(temperature=0.7, seed=3)
    state = SamplingState(params, backend.vocab_size, "cpu")
    token, q = propose(state, logits, walk)
    assert allowed[token] and q[~allowed].abs().sum() == 0 and q[token] > 0
    masked = logits.masked_fill(~allowed, float("-inf"))
    expected = probabilities(process_logits(masked[None], [state]), [state])[0]
    assert torch.allclose(q.float(), expected, atol=1e-3)
    assert propose(state, logits, None)[1][~allowed].sum() > 0.5  # unconstrained: mostly outside


def test_medusa_tree_ranks_only_allowed_tokens_along_each_path(backend, tok):
    choices = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    logits = torch.randn(3, backend.vocab_size, generator=torch.Generator().manual_seed(2))
    output = ids(tok, "the")
    tree = constrained_tree(choices, logits, output[-1], walk_of(backend, CHOICE, output), topk=2)
    assert len(tree.tokens) > 1
    for node in range(1, len(tree.tokens)):
        path, c = [], node
        while c > 0:
            path.append(tree.tokens[c])
            c = tree.parents[c]
        assert inside(backend, CHOICE, output, path[::-1]), tok.decode(path[::-1])
    forced = constrained_tree(choices, logits, 0, walk_of(backend, JSON_SPEC), topk=2)
    assert forced.parents == (-1, 0, 1, 2) and tok.decode(forced.tokens[1:]).startswith('{"')


def test_the_draft_reads_a_sequences_output_from_its_pairs(tmp_path, tok):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    grammars = DraftGrammars(model, -(-len(tok) // 64) * 64)
    params = SamplingParams(temperature=0, structured_output=CHOICE)
    prompt, out = ids(tok, "hello there"), ids(tok, "the weather")
    grammars.added(1, params, 0)
    grammars.absorbed(1, 0, prompt[1:] + out[:1])  # the prefill's pairs: the first output token last
    walk = grammars.walk(1)
    assert walk.grammar.history == out[:1]
    walk.close()
    grammars.absorbed(1, len(prompt), out[1:])  # a verify's accepted pairs
    assert grammars.walk(1).grammar.history == out
    grammars.forked(2, 1, len(prompt) - 1, params, len(prompt) + 0)  # resumed-style: output known
    grammars.absorbed(2, len(prompt) - 1, out)
    assert grammars.walk(2).grammar.history == out
    grammars.added(3, params, len(prompt))
    grammars.absorbed(3, 0, prompt[1:] + ids(tok, "zzz"))  # an output the grammar refuses
    assert grammars.walk(3) is None
    grammars.added(4, params, 0)
    grammars.absorbed(4, 5, out)  # a gap: the output is unknown
    assert grammars.walk(4) is None
    off = DraftGrammars(model, 64, enabled=False)
    off.added(1, params, 0)
    off.absorbed(1, 0, out)
    assert off.walk(1) is None


# -- the EAGLE engine, driven directly ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)
    head_dir = random_eagle_checkpoint(tmp_path_factory.mktemp("heads") / "h", model, seed=3)
    return model, head_dir, load_draft_head("eagle", head_dir, model, "float32", "cpu")


def prefilled_rig(tiny, tok, spec, params, shape, output, **kw):
    model, head_dir, head = tiny
    rig = Rig(head, head_dir, model, shape=shape, **kw)
    prompt = ids(tok, "hello there, the weather")
    tokens = prompt[1:] + output
    rig.feed({1: (0, tuple(tokens), torch.randn(len(tokens), head.feature_width))})
    sampler = SamplingParams(**params, structured_output=spec)
    return rig, [AddSequence(1, sampler, num_prompt_tokens=len(prompt))]


def paths(tokens, parents):
    """Each node's path of tokens below the root (a chain: parents 0, 1, ...)."""
    parents = parents or tuple(range(len(tokens)))
    out = []
    for node in range(len(tokens)):
        path, c = [], node
        while c >= 0:
            path.append(tokens[c])
            c = parents[c] - 1
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}], ids=["greedy", "sampled"])
def test_engine_drafts_never_leave_the_grammar(tiny, tok, backend, shape, params, monkeypatch):
    output = ids(tok, "the")
    rig, ops = prefilled_rig(tiny, tok, CHOICE, params, shape, output, top_k=3, budget=8)
    sent = []
    monkeypatch.setattr(rig.peer, "send_probs", sent.append)
    result = rig.draft({1: 4}, ops)
    drafts, parents = result.tokens[1], (result.parents or {}).get(1)
    assert drafts
    for path in paths(drafts, parents):
        assert inside(backend, CHOICE, output, path), tok.decode(path)
    if shape == "chain" and params["temperature"]:
        q = sent[0].probs[1]
        assert q.shape[0] == len(drafts) and all(q[i, t] > 0 for i, t in enumerate(drafts))


def test_engine_proposes_a_forced_run_free_and_within_the_cap(tiny, tok, monkeypatch):
    rig, ops = prefilled_rig(tiny, tok, JSON_SPEC, {"temperature": 1.0, "seed": 1}, "chain", [])
    rig.engine.head = head = CountingHead(rig.engine.head)
    sent = []
    monkeypatch.setattr(rig.peer, "send_probs", sent.append)
    result = rig.draft({1: 3}, ops)
    assert tok.decode(result.tokens[1]) == tok.decode(ids(tok, '{"name": "'))[: len(tok.decode(result.tokens[1]))]
    assert len(result.tokens[1]) == 3 and head.calls == 0  # capped at 3, no head step
    q = sent[0].probs[1]
    assert torch.equal(q.float().sum(-1), torch.ones(3)) and all(q[i, t] == 1 for i, t in enumerate(result.tokens[1]))


class CountingHead:
    def __init__(self, head):
        self._head, self.calls = head, 0

    def __getattr__(self, name):
        return getattr(self._head, name)

    def logits(self, features):
        self.calls += 1
        return self._head.logits(features)


def test_unconstrained_when_turned_off(tiny, tok, backend):
    model, head_dir, head = tiny
    rig, ops = prefilled_rig(tiny, tok, JSON_SPEC, {"temperature": 0}, "chain", [])
    rig.engine.grammars = DraftGrammars(model, head.config.vocab_size, enabled=False)
    result = rig.draft({1: 3}, ops)
    assert len(result.tokens[1]) == 3 and not inside(backend, JSON_SPEC, [], result.tokens[1][:1])
