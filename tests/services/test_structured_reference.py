"""tandem's greedy structured output, token for token, against a reference built on transformers:
LlamaForCausalLM on the same fp32 weights, each step's logits masked by the same grammar and the
masked argmax taken. The reference shares only the compile with tandem (the backend's compiled
grammar, copied): it walks llguidance's matcher itself, fed the tokens so far, and unpacks each
mask with its own shifts, so tandem's matcher rollbacks, chain and tree rows and unpacking are
all under test. With EAGLE speculation on (chains and the CPU's tree shape) and off."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tandem.structured.llguidance_backend import LlguidanceBackend
from tandem.structured.spec import StructuredOutput
from tandem.v1 import generate_pb2 as pb
from tests.services.eagle_fixtures import tiny_model, trained_head  # noqa: F401 (fixtures)
from tests.services.harness import generate
from tests.services.test_structured_output import SCHEMAS
from tests.services.test_structured_speculation import services  # noqa: F401 (fixture: EAGLE chain and tree stacks)

MAX_TOKENS = 60
PROMPTS = ("The weather today", "Once upon a time, there was")
SPECS = {  # the public message and the same spec as the backend takes it
    "json-nested": StructuredOutput("json_schema", json.dumps(SCHEMAS[2])),
    "json-array": StructuredOutput("json_schema", json.dumps(SCHEMAS[1])),
    "regex": StructuredOutput("regex", r"(the|a) [a-z]{1,8}( [a-z]{1,8}){2,5}\."),
    "choice": StructuredOutput("choice", ("the weather is fine", "it rains all day", "the sun", "snow")),
}


def message(spec: StructuredOutput) -> pb.StructuredOutput:
    if spec.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(values=list(spec.value)))
    return pb.StructuredOutput(**{spec.kind: spec.value})


def allowed_of(matcher, vocab_size: int) -> torch.Tensor:
    """[V] bool: the tokens llguidance's matcher allows next (bit t % 32 of word t // 32)."""
    words = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


@torch.no_grad()
def masked_greedy(model, backend: LlguidanceBackend, spec: StructuredOutput, prompt: list[int]) -> list[int]:
    """Greedy decoding with each step's logits masked by the grammar; ends at EOS (included, as
    tandem streams it) or MAX_TOKENS."""
    matcher = backend.compile(spec).template.deep_copy()  # llguidance's LLMatcher at the start
    out, cache, inputs = [], None, torch.tensor([prompt])
    while len(out) < MAX_TOKENS:
        step = model(input_ids=inputs, cache=cache, use_cache=True)
        cache, logits = step.cache, step.logits[0, -1]
        allowed = allowed_of(matcher, backend.vocab_size)
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token in backend.eos_token_ids:
            break
        assert matcher.consume_token(token), matcher.get_error()
        inputs = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def reference(tiny_model):  # noqa: F811
    """(spec name, prompt) -> (prompt ids, the reference's greedy tokens)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    backend = LlguidanceBackend.from_model_dir(tiny_model, model.config.vocab_size)
    out = {}
    for name, spec in SPECS.items():
        for prompt in PROMPTS:
            ids = tok(prompt, add_special_tokens=False).input_ids
            out[name, prompt] = ids, masked_greedy(model, backend, spec, ids)
    return out


@pytest.mark.parametrize("name", SPECS)
def test_greedy_equals_the_masked_transformers_reference(services, reference, name):
    drafted = 0
    for prompt in PROMPTS:
        ids, expected = reference[name, prompt]
        assert 2 < len(expected) < MAX_TOKENS and expected[-1] == 2, expected  # the grammar ended it
        for speculate in (False, True):
            params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, speculate=speculate,
                                       structured_output=message(SPECS[name]))
            out, _, _, last = generate(services.stub, token_ids=ids, params=params)
            assert out == expected, (name, prompt, speculate)
            assert last.choices[0].finish_reason == "stop"
            drafted += last.usage.draft_tokens if speculate else 0
    if name != "choice":
        assert drafted > 0  # the drafts were verified under the masks
