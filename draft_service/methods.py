"""Draft methods, chosen by name from one registry (Medusa joins with its issue)."""

from pathlib import Path

from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument
from tandem.models.loader import parse_dtype


def load_eagle(model_dir: Path, target_dir: Path, dtype: str, device: str):
    from tandem.models.config import ModelConfig
    from tandem.models.eagle import load_eagle_head

    # The head's rope table must span the target's context, whatever the head's config says.
    positions = ModelConfig.from_folder(target_dir).max_position_embeddings
    backend = TorchAttention(device)
    return load_eagle_head(model_dir, target_dir, dtype=parse_dtype(dtype), backend=backend, device=device, max_positions=positions)


DRAFT_METHODS = {"eagle": load_eagle}


def load_draft_head(method: str, model_dir: Path, target_dir: Path, dtype: str, device: str):
    if method not in DRAFT_METHODS:
        raise InvalidArgument(f"draft method {method!r} is not one of {sorted(DRAFT_METHODS)}")
    return DRAFT_METHODS[method](model_dir, target_dir, dtype, device)
