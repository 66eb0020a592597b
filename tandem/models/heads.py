"""The draft heads shipped in the repository's heads/ folder, and what `tandem up` serves by
default: the shipped EAGLE head when the model is the default one, drafting in a shape that
suits the device.

Why the shape depends on the device: on a GPU a verify pass of k + 1 tokens costs about what one
token does, so longer drafts pay (EAGLE's chains of 4). On a CPU the fp32 target is
compute-bound past one token: each extra verified token costs about 7% of a decode step here
(SmolLM2-135M, 2 cores: 48 ms plain, +2.5 to +3.5 ms per drafted token) and a draft depth about
10%, while the head accepts a second position only ~1 time in 4. So on a CPU it drafts one
depth with its top 3 tokens as siblings (a tree of depth 1): measured here on 10 MT-bench
questions x 96 tokens, 1.105x plain, against 1.077x for a chain of 1, 1.028x for 2, 0.944x
for 3 (the k sweep in the README's Benchmarks).
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


CPU_SHAPE = DraftShape("tree", k=1, tree_top_k=3, tree_node_budget=3)
GPU_SHAPE = DraftShape("chain", k=4)


def default_draft(model_given: bool) -> tuple[str, Path | None]:
    """(method, head) for `--draft auto`: the shipped EAGLE head serves the default model; a
    model of the user's own has no head we know of, so it decodes plainly."""
    if model_given or not (EAGLE_HEAD / "config.json").is_file():
        return "none", None
    return "eagle", EAGLE_HEAD


def default_shape(device: str) -> DraftShape:
    return CPU_SHAPE if device == "cpu" else GPU_SHAPE
