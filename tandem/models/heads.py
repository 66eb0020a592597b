"""The draft heads shipped in the repository's heads/ folder, and what `tandem up` serves by
default.

`--draft auto` drafts with the shipped EAGLE head on GPUs, where a verify pass of a few dozen
tokens costs about what one token does, in an EAGLE-2 dynamic tree of depth 4 that keeps the 30
most probable nodes of each frontier node's top-8 children. Served on the first 10 MT-bench
questions x 96 tokens (head v4, fp32 target; `tandem bench --mode shapes`, README Benchmarks),
that tree accepts 1.98 tokens per verify greedy and 1.55 at temperature 1, against 1.46 and
1.45 for a chain of 4 (a 16-node top-4 tree: 1.77 and 1.41). Both take 4 draft rounds a step;
the tree's are wider. With head v5 on all 80 questions x 128 tokens (`tandem bench --mode spec`)
the tree accepts 2.23 greedy against 1.59 for the chain. Its cost on a GPU has not been measured
here. `--draft medusa` on a GPU verifies the first 30 nodes of the Medusa head's own tree (the
same node budget; listed best first, tandem.models.medusa): walked 1.72 on questions 41-80,
fit on 1-40.

On a CPU it decodes plainly: here (SmolLM2-135M fp32, 2 cores, Intel Xeon) a decode step of one
token takes 32 ms of target compute and a verify of two 37 ms (the kernels by row count in
tandem.models.linear), the head's served depth-1 acceptance is about 0.35-0.5, and each step
adds the draft's 5 ms and its RPC. The best shape measured, a depth-1 tree of the draft's 2 best
tokens, gains 1.08-1.12x plain for one stream (head v5; all 80 MT-bench questions: 1.08x greedy
and at temperature 1) and loses with concurrent streams, where a step verifies 3 tokens a
sequence: not worth a third process by default. `--draft eagle` or `--draft medusa` without
`--draft-model` serve the shipped heads anyway (the demo does, to show speculation at work), in
the device's shape: on a CPU that depth-1 tree of 2 nodes (Medusa: the first 2 nodes of its tree; 3, 8 and 12
nodes measured 0.94x, 0.93x and 0.87x plain against 1.02x for 2), drafting only for a stream
decoding alone (the router's --spec-disable-batch-size 2): with 8 streams drafting runs at
0.91-0.98x plain greedy (0.81-0.87x at temperature 1), paused at 1.00-1.02x (16 questions; README
Benchmarks). On GPUs the pause is off: where a large batch's verify stops paying there is not
measured here.

On an AMD EPYC (2 cores, AVX2), with the CPU kernels measured at load and the draft's lm_head in
int8 (`--draft-lm-head-quant auto`, below), plain decoding ran at 19.5 tok/s and the same 2-node
tree at 0.99x, chains of 1-4 at 0.82-0.94x (16 MT-bench questions x 128 tokens; README
Benchmarks): still no reason for a third process by default.
"""

from dataclasses import dataclass
from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"
EAGLE_HEAD = HEADS_DIR / "eagle-smollm2-135m"  # for SmolLM2-135M-Instruct, the default model
MEDUSA_HEAD = HEADS_DIR / "medusa-smollm2-135m"


@dataclass(frozen=True, slots=True)
class DraftShape:
    shape: str  # "chain" or "tree"
    k: int  # chain length, tree depth at most
    tree_top_k: int = 4
    tree_node_budget: int = 16
    spec_disable_batch_size: int = 0  # the router's: steps decoding this many sequences draft nothing (0: never)


CPU_SHAPE = DraftShape("tree", k=1, tree_top_k=2, tree_node_budget=2, spec_disable_batch_size=2)
GPU_SHAPE = DraftShape("tree", k=4, tree_top_k=8, tree_node_budget=30)
SHIPPED = {"eagle": EAGLE_HEAD, "medusa": MEDUSA_HEAD}


def default_draft(model_given: bool, device: str) -> str:
    """The method `--draft auto` means: EAGLE with the shipped head for the default model on a
    GPU; plain decoding on a CPU (see above), and for a model of the user's own (no head known)."""
    return "none" if model_given or device == "cpu" or shipped_head("eagle") is None else "eagle"


def lm_head_quant(asked: str, device: str) -> str:
    """--draft-lm-head-quant made concrete: auto is int8 on CPU, where the draft's lm_head is
    most of a draft step's bytes (README: Benchmarks), and none elsewhere."""
    if asked != "auto":
        return asked
    return "int8" if device == "cpu" else "none"


def shipped_head(method: str) -> Path | None:
    """The shipped head of a method, for the default model; None when there is none."""
    head = SHIPPED.get(method)
    return head if head is not None and (head / "config.json").is_file() else None


def default_shape(device: str) -> DraftShape:
    return CPU_SHAPE if device == "cpu" else GPU_SHAPE


def device_shape_flags(args) -> dict:
    """The device's value of each shape flag (--spec-draft-length, --tree-top-k,
    --tree-node-budget, --spec-disable-batch-size) that args leaves unset (None)."""
    shape = default_shape(args.device)
    values = {"spec_draft_length": shape.k, "tree_top_k": shape.tree_top_k, "tree_node_budget": shape.tree_node_budget,
              "spec_disable_batch_size": shape.spec_disable_batch_size}
    return {name: value for name, value in values.items() if getattr(args, name) is None}
