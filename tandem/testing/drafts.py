"""Draft heads for tests: random EAGLE-3 checkpoints, Medusa heads saved as a checkpoint, and a
head loaded as the draft service loads it."""

from pathlib import Path

import torch

from tandem.models.config import ModelConfig
from tandem.models.eagle3 import Eagle3Config, eagle3_config_for_target, expected_shapes
from tandem.models.eagle_io import save_eagle_checkpoint
from tandem.models.medusa import MedusaHeads, save_medusa_checkpoint


def random_eagle3_state_dict(raw: dict, target: ModelConfig, *, seed: int = 0,
                             vocab_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Random weights for an EAGLE-3 head config (public keys), scaled to keep activations O(1);
    norms near, not at, 1 so a dropped norm shows. vocab_ids: a pruned draft vocabulary."""
    config = Eagle3Config.from_dict(raw, target)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    if vocab_ids is not None:
        state["d2t"] = vocab_ids.to(torch.int64) - torch.arange(len(vocab_ids))
    return state


def random_eagle3_checkpoint(out_dir: Path, target_dir: Path, *, seed: int = 0, vocab_ids: torch.Tensor | None = None,
                             aux_layers: tuple[int, ...] | None = None, format: str = "safetensors") -> Path:
    """A random-weight EAGLE-3 head for the target in the public format."""
    raw = eagle3_config_for_target(target_dir, draft_vocab_size=None if vocab_ids is None else len(vocab_ids),
                                   aux_layers=aux_layers)
    state = random_eagle3_state_dict(raw, ModelConfig.from_folder(target_dir), seed=seed, vocab_ids=vocab_ids)
    return save_eagle_checkpoint(out_dir, raw, state, format=format)


def save_medusa_heads(out_dir: Path, heads: MedusaHeads, *, format: str = "safetensors") -> Path:
    """Loaded heads written back in the public format (a round trip's second half)."""
    config = {"architectures": ["MedusaModel"], **heads.config.to_dict()}
    return save_medusa_checkpoint(out_dir, config, heads.state_dict(), format=format)


def load_draft_head(method: str, model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
                    head_int8: bool = False):
    """The head `tandem draft --method METHOD` serves (draft_service.methods)."""
    from draft_service.methods import draft_method

    return draft_method(method).load(model_dir, target_dir, dtype, device, lm_head_int8, head_int8)
