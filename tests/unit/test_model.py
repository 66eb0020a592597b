"""Our Llama-family model over the paged cache matches Hugging Face's, logit for logit, in fp32.

Each case builds a tiny random-weight checkpoint, loads it twice (ours with the torch attention
backend, HF's reference) and runs our model the way the target engine does: packed batches of
prefill chunks and decode tokens, slots from the page allocator, copy-on-write copies applied
before the forward pass. Page size 4, so prompts span pages and forks land mid-page.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.attention.base import SequenceSlice
from tandem.attention.torch_backend import TorchAttention
from tandem.kv.cache import PagedKVCache
from tandem.models.kernel_plan import KernelPlan
from tandem.models.llama import ForwardBatch, LlamaModel
from tandem.models.loader import load_model
from tandem.testing.tiny import build_tiny_model

ATOL = 1e-4
PAGE_SIZE = 4

VARIANTS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False),
    "llama-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-llama3": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-yarn": dict(
        arch="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    ),
}


class Runner:
    """Our model plus its paged cache, stepped like TargetEngine._prepare / _run."""

    def __init__(self, model: LlamaModel, num_pages: int = 64, page_size: int = PAGE_SIZE):
        c = model.config
        self.model = model
        self.cache = PagedKVCache(
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            num_pages=num_pages,
            page_size=page_size,
            dtype=model.dtype,
        )
        self.tokens: dict[int, list[int]] = {}
        self.num_copies = 0

    @property
    def alloc(self):
        return self.cache.allocator

    def add(self, seq_id: int) -> None:
        self.alloc.add(seq_id)
        self.tokens[seq_id] = []

    def fork(self, seq_id: int, parent_id: int, position: int) -> None:
        self.alloc.fork(seq_id, parent_id, position)
        self.tokens[seq_id] = self.tokens[parent_id][:position]

    def step(self, entries: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One packed forward pass; returns each entry's logits [num_new, V] (fp32)."""
        ids, positions, slots, slices, spans = [], [], [], [], []
        for seq_id, token_ids in entries:
            cached = self.alloc.length(seq_id)
            new_slots, copies = self.alloc.append(seq_id, len(token_ids))
            self.cache.apply_copies(copies)
            self.num_copies += len(copies)
            self.tokens[seq_id].extend(token_ids)
            spans.append((len(ids), len(ids) + len(token_ids)))
            ids.extend(token_ids)
            positions.extend(range(cached, cached + len(token_ids)))
            slots.extend(new_slots)
            slices.append(SequenceSlice(cached, len(token_ids), self.alloc.slots(seq_id)))
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            plan=self.model.backend.plan(slices, self.model.config.sliding_window),
        )
        logits = self.model.logits(self.model.forward(batch, self.cache))
        return [logits[a:b] for a, b in spans]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny checkpoints, built once per module on first use."""
    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(name: str, **kwargs):
        if name not in built:
            built[name] = build_tiny_model(root / name, **(kwargs or VARIANTS[name]))
        return built[name]

    return get


def ours(folder, dtype=torch.float32) -> LlamaModel:
    return load_model(folder, dtype=dtype, backend=TorchAttention())


def reference(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [len, V]


def prompt(seed: int, length: int, vocab: int = 400) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff}"


# -- (a) packed prefill, (b) batched decode, for every architecture and rope scaling -------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_prefill_then_batched_decode_match_hf(folders, variant):
    folder = folders(variant)
    model, hf = ours(folder), reference(folder)
    run = Runner(model)
    run.add(1)
    run.add(2)
    a, b = prompt(1, 11), prompt(2, 6)
    out_a, out_b = run.step([(1, a), (2, b)])
    step_logits = {1: [out_a], 2: [out_b]}
    for _ in range(3):  # greedy decode, both sequences in one batch
        next_a = int(step_logits[1][-1][-1].argmax())
        next_b = int(step_logits[2][-1][-1].argmax())
        out_a, out_b = run.step([(1, [next_a]), (2, [next_b])])
        step_logits[1].append(out_a)
        step_logits[2].append(out_b)
    for seq_id in (1, 2):
        assert len(run.tokens[seq_id]) == len(a if seq_id == 1 else b) + 3
        assert_close(torch.cat(step_logits[seq_id]), hf_logits(hf, run.tokens[seq_id]))


def test_loaded_config_matches_checkpoint(folders):
    qwen = ours(folders("qwen2")).config
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.sliding_window is None
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    tied = ours(folders("llama"))
    assert tied.config.tie_word_embeddings and tied.config.eos_token_ids == (2,)
    assert_close(tied.logits(hidden), hidden @ tied.weights.embed.T)  # whatever lm_head's layout
    untied = ours(folders("llama-untied"))
    assert not untied.config.tie_word_embeddings
    assert (untied.logits(hidden) - hidden @ untied.weights.embed.T).abs().max() > 1e-2


def test_a_model_holds_its_kernel_plan_and_gives_it_to_every_projection(folders):
    plan = KernelPlan(("flat", "blocked", "matvec"))
    model = load_model(folders("llama"), dtype=torch.float32, backend=TorchAttention(), kernels=plan)
    assert model.kernels == plan and {p.plan for p in model.weights.projections()} == {plan}
    timed = ours(folders("llama"))  # timed on its projections, on CPU
    assert {p.plan for p in timed.weights.projections()} == {timed.kernels}


# -- (c) chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_equals_one_shot(folders):
    folder = folders("llama")
    model, hf = ours(folder), reference(folder)
    tokens = prompt(3, 13)
    one_shot = Runner(model)
    one_shot.add(1)
    (whole,) = one_shot.step([(1, tokens)])
    chunked = Runner(model)
    chunked.add(1)
    (first,) = chunked.step([(1, tokens[:6])])  # the chunk ends mid-page
    (second,) = chunked.step([(1, tokens[6:])])
    assert_close(torch.cat([first, second]), whole)
    assert_close(whole, hf_logits(hf, tokens))
    # The chunk may share its batch with another sequence's decode.
    other = prompt(4, 3)
    chunked.add(2)
    chunked.step([(2, other)])
    (decode, third) = chunked.step([(1, [5]), (2, [7, 8, 9, 10, 11])])
    assert_close(decode, hf_logits(hf, tokens + [5])[-1:])
    assert_close(third, hf_logits(hf, other + [7, 8, 9, 10, 11])[-5:])


# -- (d) fork with copy-on-write -------------------------------------------------------------------


def test_forks_mid_page_match_from_scratch_and_parent_continues(folders):
    folder = folders("llama")
    model, hf = ours(folder), reference(folder)
    run = Runner(model)
    run.add(1)
    parent = prompt(5, 7)  # pages [0, 1]; page 1 holds tokens 4..6
    run.step([(1, parent)])
    run.fork(2, 1, 7)  # shares the partial page 1 whole
    run.fork(3, 1, 5)  # shares page 1 for token 4 only
    assert run.alloc.page_table(2) == run.alloc.page_table(3) == run.alloc.page_table(1)
    # All three write into the shared page in one batch: parent and child 2 get private copies
    # (the parent's own continuation must not overwrite the children's view), child 3 is then
    # the last holder and writes in place.
    outs = run.step([(1, [11]), (2, [22, 23]), (3, [33, 34, 35])])
    assert run.num_copies == 2
    tables = [run.alloc.page_table(s) for s in (1, 2, 3)]
    assert len({t[1] for t in tables}) == 3  # every sequence now owns its page 1
    for seq_id, out in zip((1, 2, 3), outs):
        full = hf_logits(hf, run.tokens[seq_id])
        assert_close(out, full[-out.shape[0] :])
    # Decode once more, all together, and compare whole histories from scratch.
    run.step([(1, [12]), (2, [24]), (3, [36])])
    assert run.tokens[1] == parent + [11, 12]
    assert run.tokens[2] == parent + [22, 23, 24]
    assert run.tokens[3] == parent[:5] + [33, 34, 35, 36]
    for seq_id in (1, 2, 3):
        scratch = Runner(model)
        scratch.add(seq_id)
        (fresh,) = scratch.step([(seq_id, run.tokens[seq_id])])
        assert_close(fresh, hf_logits(hf, run.tokens[seq_id]))
        (last,) = run.step([(seq_id, [40])])
        (fresh_last,) = scratch.step([(seq_id, [40])])
        assert_close(last, fresh_last)


def test_fork_then_pop_rewrites_only_the_child(folders):
    """Pop the child back into the shared page and write other tokens: the parent keeps its KV."""
    folder = folders("llama")
    model, hf = ours(folder), reference(folder)
    run = Runner(model)
    run.add(1)
    parent = prompt(6, 8)
    run.step([(1, parent)])
    run.fork(2, 1, 8)
    run.alloc.pop(2, 3)
    del run.tokens[2][-3:]
    (child,) = run.step([(2, [50, 51])])
    assert run.num_copies == 1
    (cont,) = run.step([(1, [60])])
    assert_close(child, hf_logits(hf, parent[:5] + [50, 51])[-2:])
    assert_close(cont, hf_logits(hf, parent + [60])[-1:])


# -- (e) sliding window ----------------------------------------------------------------------------


def test_mistral_sliding_window_matches_hf(folders):
    folder = folders("mistral-window", arch="mistral")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["sliding_window"] = 8
    config_path.write_text(json.dumps(config))
    model = ours(folder)
    assert model.config.sliding_window == 8
    hf = reference(folder)
    tokens = prompt(7, 20)
    want = hf_logits(hf, tokens)
    # HF applies the window with its default (sdpa) attention: eager agrees, no window differs.
    assert_close(want, hf_logits(reference(folder, attn_implementation="eager"), tokens))
    config["sliding_window"] = None
    config_path.write_text(json.dumps(config))
    unwindowed = hf_logits(reference(folder), tokens)
    assert (unwindowed[8:] - want[8:]).abs().max() > 1e-2
    assert_close(unwindowed[:8], want[:8])

    run = Runner(model)
    run.add(1)
    run.add(2)
    short = prompt(8, 3)
    first, other = run.step([(1, tokens[:11]), (2, short)])  # a chunk past the window, batched
    (second,) = run.step([(1, tokens[11:])])
    assert_close(torch.cat([first, second]), want)
    # Decode past the window; the other sequence stays inside it.
    out1, out2 = run.step([(1, [9]), (2, [10])])
    config["sliding_window"] = 8
    config_path.write_text(json.dumps(config))
    hf = reference(folder)
    assert_close(out1, hf_logits(hf, tokens + [9])[-1:])
    assert_close(torch.cat([other, out2]), hf_logits(hf, short + [10]))


# -- bf16 ------------------------------------------------------------------------------------------


def test_bf16_load_runs_and_mostly_agrees_with_fp32(folders):
    folder = folders("llama")
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = ours(folder, dtype)
        assert model.dtype == dtype and model.weights.embed.dtype == dtype
        run = Runner(model)
        assert run.cache.k[0].dtype == dtype
        run.add(1)
        run.add(2)
        out = run.step([(1, prompt(9, 24)), (2, prompt(10, 9))])
        out += run.step([(1, [3]), (2, [4])])
        runs[dtype] = torch.cat(out)
    low, full = runs[torch.bfloat16], runs[torch.float32]
    assert low.dtype == torch.float32  # logits come back in fp32
    assert torch.isfinite(low).all()
    agree = (low.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
