"""Draft methods, chosen by name from one registry: how each loads its head. (The engine each
method runs is draft_service.server's registry.) Importing this module imports no torch: the
command line reads the method names from it."""

from pathlib import Path

from tandem.errors import InvalidArgument


def load_eagle(model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
               head_int8: bool = False):
    """An EAGLE-1/2 head, or an EAGLE-3 one (told apart by its config and weights)."""
    from tandem.attention.torch_backend import TorchAttention
    from tandem.models.config import ModelConfig
    from tandem.models.eagle import load_eagle_head
    from tandem.models.eagle3 import is_eagle3_folder, load_eagle3_head
    from tandem.models.loader import parse_dtype

    # The head's rope table must span the target's context, whatever the head's config says.
    positions = ModelConfig.from_folder(target_dir).max_position_embeddings
    backend = TorchAttention(device)
    load = load_eagle3_head if is_eagle3_folder(model_dir) else load_eagle_head
    return load(model_dir, target_dir, dtype=parse_dtype(dtype), backend=backend, device=device,
                max_positions=positions, lm_head_int8=lm_head_int8, head_int8=head_int8)


def load_medusa(model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
                head_int8: bool = False):
    if head_int8:
        raise InvalidArgument("int8 head projections are an EAGLE head's: Medusa's blocks stay in the model's dtype")
    from tandem.models.loader import parse_dtype
    from tandem.models.medusa import load_medusa_heads

    return load_medusa_heads(model_dir, target_dir, dtype=parse_dtype(dtype), device=device, lm_head_int8=lm_head_int8)


DRAFT_METHODS = {"eagle": load_eagle, "medusa": load_medusa}

# The draft shape of a deployment that names none. EAGLE: a chain (a tree costs a draft forward
# per depth over the whole frontier; worth it where drafting is cheap next to verifying, as on
# a GPU); Medusa: its static tree, which costs no more than a chain (one heads pass).
DEFAULT_SHAPES = {"eagle": "chain", "medusa": "tree"}


def load_draft_head(method: str, model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
                    head_int8: bool = False):
    if method not in DRAFT_METHODS:
        raise InvalidArgument(f"draft method {method!r} is not one of {sorted(DRAFT_METHODS)}")
    return DRAFT_METHODS[method](model_dir, target_dir, dtype, device, lm_head_int8, head_int8)
