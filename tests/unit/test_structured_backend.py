"""The grammar backend on llguidance with a real byte-level tokenizer: compile, the cache by
content, bad specs with the compiler's message, a sequence's matcher: validate before consume,
rollback, EOS after the grammar stopped."""

import json

import pytest

from tandem.errors import InvalidArgument
from tandem.structured.llguidance_backend import LlguidanceBackend
from tandem.structured.masks import chain_masks, tree_masks
from tandem.structured.matcher import SequenceGrammar
from tandem.structured.spec import StructuredOutput
from tandem.testing.tiny import build_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    vocab = -(-len(tok) // 64) * 64  # padded, as the tiny models are
    return LlguidanceBackend(tok.backend_tokenizer.to_str(), vocab, [EOS])


def grammar_of(backend, spec):
    return SequenceGrammar(backend.new_matcher(backend.compile(spec)), backend.eos_token_ids)


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_compiled_grammars_are_cached_by_content(backend):
    a = backend.compile(StructuredOutput("regex", "[0-9]+"))
    assert backend.compile(StructuredOutput("regex", "[0-9]+")) is a
    assert backend.compile(StructuredOutput("regex", "[0-9]*")) is not a
    assert backend.compile(StructuredOutput("grammar", "start: /[0-9]+/")) is not a


@pytest.mark.parametrize("spec, field, message", [
    (StructuredOutput("regex", "a(b"), "params.structured_output.regex", "unclosed group"),
    (StructuredOutput("json_schema", '{"type": "foo"}'), "params.structured_output.json_schema", "foo"),
    (StructuredOutput("json_schema", "{nope"), "params.structured_output.json_schema", "not valid JSON"),
    (StructuredOutput("json_schema", "[1]"), "params.structured_output.json_schema", "JSON object"),
    (StructuredOutput("grammar", "start: foo"), "params.structured_output.grammar", 'unknown name: "foo"'),
    (StructuredOutput("choice", ()), "params.structured_output.choice", "empty"),
    (StructuredOutput("regex", ""), "params.structured_output.regex", "empty"),
    (StructuredOutput("json_object", False), "params.structured_output.json_object", "true"),
    (StructuredOutput("regex", "a" * 70_000), "params.structured_output.regex", "at most"),
])
def test_a_bad_spec_names_its_field_with_the_compilers_message(backend, spec, field, message):
    with pytest.raises(InvalidArgument) as e:
        backend.compile(spec)
    assert str(e.value).startswith(field) and message in str(e.value)


def test_validate_before_consume_keeps_the_matcher_usable(backend, tok):
    g = grammar_of(backend, StructuredOutput("choice", ("yes", "no")))
    bad = ids(tok, "maybe")[0]
    assert not g.accept(bad) and g.history == []  # refused, never fed
    assert g.sync(ids(tok, "yes"))
    assert g.matcher.is_stopped()


def test_rollback_and_sync_move_the_state(backend, tok):
    g = grammar_of(backend, StructuredOutput("regex", "(ab|cd)+"))
    out = ids(tok, "abcdab")
    assert g.sync(out) and g.history == out
    g.rollback_to(0)
    assert g.history == [] and g.sync(ids(tok, "cd"))
    assert not g.sync(ids(tok, "cx"))  # stops at the longest valid prefix
    assert g.history == ids(tok, "c")[:1] or len(g.history) < len(ids(tok, "cx"))


def test_eos_after_the_grammar_stopped_is_recorded_not_fed(backend, tok):
    g = grammar_of(backend, StructuredOutput("choice", ("yes",)))
    yes = ids(tok, "yes")
    assert g.sync(yes) and g.matcher.is_stopped()
    assert g.accept(EOS) and g.accept(EOS)
    assert not g.accept(yes[0])  # nothing but EOS now
    g.rollback_to(len(yes) - 1)  # two unfed EOS and one real token back
    assert not g.matcher.is_stopped() and g.accept(yes[-1])


def test_chain_masks_walk_the_drafts_and_roll_back(backend, tok):
    g = grammar_of(backend, StructuredOutput("regex", "[a-c]{3}"))
    a, b, z = ids(tok, "a")[0], ids(tok, "b")[0], ids(tok, "z")[0]
    masks = chain_masks(g, [a, z, b], backend.vocab_size)
    assert masks.shape == (4, backend.vocab_size) and g.history == []
    assert masks[0, a] and masks[0, b] and not masks[0, z] and not masks[0, EOS]
    assert masks[1, a] and not masks[1, z]
    assert masks[2:].all()  # after the refused draft z: never reached, left all-allowed
    masks = chain_masks(g, [a, b, a], backend.vocab_size)
    assert masks[3].nonzero().flatten().tolist() == [EOS]  # complete: only EOS


def test_tree_masks_give_each_node_its_paths_row(backend, tok):
    g = grammar_of(backend, StructuredOutput("choice", ("ab", "ba")))
    g.sync([])
    a, b = ids(tok, "a")[0], ids(tok, "b")[0]
    # node 0 stands for the last emitted token (already consumed): here the start
    masks = tree_masks(g, [0, a, b, b, a], [0, 0, 1, 2], backend.vocab_size)
    assert g.history == []
    assert masks[0, a] and masks[0, b]
    assert masks[1, b] and not masks[1, a]  # after "a": "b"
    assert masks[2, a] and not masks[2, b]  # after "b": "a"
    assert masks[3].nonzero().flatten().tolist() == [EOS]
    assert masks[4].nonzero().flatten().tolist() == [EOS]


def test_json_schema_mask_cost_is_bounded(backend, tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = grammar_of(backend, StructuredOutput("json_schema", json.dumps(schema)))
    text = ids(tok, '{"n": 12}')
    masks = chain_masks(g, text, backend.vocab_size)
    assert all(masks[j, t] for j, t in enumerate(text))


def test_a_compile_over_the_wall_clock_cap_is_invalid_argument_naming_the_field_and_the_cap(tok):
    vocab = -(-len(tok) // 64) * 64
    hurried = LlguidanceBackend(tok.backend_tokenizer.to_str(), vocab, [EOS], compile_timeout_s=1e-4)
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,40}"} for i in range(300)}}
    spec = StructuredOutput("json_schema", json.dumps(big))
    with pytest.raises(InvalidArgument) as e:
        hurried.compile(spec)
    assert str(e.value).startswith("params.structured_output.json_schema: compiling took over 0.0001 s")
    assert hurried.cached() == 0  # the late result is never cached
    roomy = LlguidanceBackend(tok.backend_tokenizer.to_str(), vocab, [EOS])
    assert roomy.compile_timeout_s == 1.0 and roomy.compile(spec).compile_s < 1.0


def test_a_compiler_error_still_reaches_the_caller_through_the_compile_thread(backend):
    with pytest.raises(InvalidArgument, match="unclosed group"):
        backend.compile(StructuredOutput("regex", "(x"))


LAYOUTS = ['{"a": 1, "b": [true, false]}', '{"a":1,"b":[true,false]}', '{ "a": 1, "b": [ true, false ] }',
           '{"a": 1,\n"b": [true, false]}']


@pytest.mark.parametrize("x_guidance, accepted", [
    (None, {0}),  # the default: one line, json.dumps's separators
    ({"item_separator": ",", "key_separator": ":"}, {1}),
    ({"whitespace_flexible": True}, {0, 2}),  # spaces around tokens; the separators stay ", " and ": "
])
def test_json_layout_defaults_to_no_free_whitespace_and_a_schema_may_override_it(backend, tok, x_guidance, accepted):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "boolean"}}},
              "required": ["a", "b"], "additionalProperties": False}
    if x_guidance:
        schema["x-guidance"] = x_guidance
    for i, text in enumerate(LAYOUTS):
        g = grammar_of(backend, StructuredOutput("json_schema", json.dumps(schema)))
        assert (g.sync(ids(tok, text)) and g.matcher.is_stopped()) == (i in accepted), (x_guidance, text)
    g = grammar_of(backend, StructuredOutput("json_object", True))
    assert not g.sync(ids(tok, '{ "k": 1}'))  # json_object too: no free whitespace
    g = grammar_of(backend, StructuredOutput("json_object", True))
    assert g.sync(ids(tok, '{"k": 1}')) and g.matcher.is_stopped()
