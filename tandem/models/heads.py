"""The draft heads shipped in the repository's heads/ folder, and what `tandem up` serves by
default: the shipped EAGLE head when the model is the default one, with a draft length that
suits the device.

Why k depends on the device: on a GPU a verify pass of k + 1 tokens costs about what one token
does, so longer drafts pay; on a CPU the target is compute-bound past one token, and each extra
verified token costs about 7% of a decode step here (SmolLM2-135M, 2 cores: 48 ms plain, +2.5 to
+3.5 ms per drafted token), so only the first draft position pays for itself
(bench/results/spec-*.json).
"""

from pathlib import Path

HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"
EAGLE_HEAD = HEADS_DIR / "eagle-smollm2-135m"  # for SmolLM2-135M-Instruct, the default model
MEDUSA_HEAD = HEADS_DIR / "medusa-smollm2-135m"
CPU_DRAFT_LENGTH = 1
GPU_DRAFT_LENGTH = 4


def default_draft(model_given: bool) -> tuple[str, Path | None]:
    """(method, head) for `--draft auto`: the shipped EAGLE head serves the default model; a
    model of the user's own has no head we know of, so it decodes plainly."""
    if model_given or not (EAGLE_HEAD / "config.json").is_file():
        return "none", None
    return "eagle", EAGLE_HEAD


def default_draft_length(device: str) -> int:
    return CPU_DRAFT_LENGTH if device == "cpu" else GPU_DRAFT_LENGTH
