"""The draft heads shipped in the repository's heads/ folder, and what `tandem up` serves by
default.

`--draft auto` drafts with the shipped EAGLE head on GPUs, where a verify pass of a few dozen
tokens costs about what one token does, in an EAGLE-2 dynamic tree of depth 4 that keeps the 30
most probable nodes of each frontier node's top-8 children: of the depth-4 shapes served, it
accepts the most tokens a verify (docs/benchmarks.md, "Which draft shape pays"; its cost on a
GPU has not been measured here). `--draft medusa` on a GPU verifies the first 30 nodes of the
Medusa head's own tree (the same node budget; listed best first, tandem.models.medusa).

On a CPU it drafts too, in an EAGLE-2 tree of depth 2 that keeps 4 nodes of each expanded node's
top-2 children, and only for a stream decoding alone (the router's --spec-disable-batch-size 2:
with concurrent streams a verify of several tokens a sequence costs more than the drafts save
here). That shape was the fastest served on a 2-core AMD EPYC once the services bounded OpenMP's
busy-waiting (tandem.cli), before which every shape lost on CPU and CPUs decoded plainly by
default: bench/results/notes/2026-12-06-openmp-busy-wait.md has the figures. Medusa on a CPU
takes the same depth and node count of its own tree.
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


CPU_SHAPE = DraftShape("tree", k=2, tree_top_k=2, tree_node_budget=4, spec_disable_batch_size=2)
GPU_SHAPE = DraftShape("tree", k=4, tree_top_k=8, tree_node_budget=30)
SHIPPED = {"eagle": EAGLE_HEAD, "medusa": MEDUSA_HEAD}


def default_draft(model_given: bool) -> str:
    """The method `--draft auto` means: EAGLE with the shipped head for the default model, on any
    device (in the device's shape); plain decoding for a model of the user's own (no head known)."""
    return "none" if model_given or shipped_head("eagle") is None else "eagle"


def lm_head_quant(asked: str, device: str) -> str:
    """--draft-lm-head-quant made concrete: auto is int8 on CPU, where the draft's lm_head is
    most of a draft step's bytes (docs/benchmarks.md), and none elsewhere."""
    if asked != "auto":
        return asked
    return "int8" if device == "cpu" else "none"


def head_quant(asked: str, device: str, method: str) -> str:
    """--draft-head-quant made concrete: auto is int8 for an EAGLE head on CPU, whose own
    projections a draft step reads once a pass (docs/benchmarks.md), and none elsewhere."""
    return lm_head_quant(asked, device) if asked != "auto" or method == "eagle" else "none"


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
