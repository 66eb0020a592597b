"""Draft methods, chosen by name from one registry: how each loads its head, the engine it runs,
what its Info says, and the shape of a deployment that names none. Importing this module imports
no torch (the command line reads the method names from it): engines are imported when built."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument
from tandem.models.kernel_plan import KernelPlan


def load_eagle(model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
               head_int8: bool = False, kernels: KernelPlan | None = None):
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
                max_positions=positions, lm_head_int8=lm_head_int8, head_int8=head_int8, kernels=kernels)


def load_medusa(model_dir: Path, target_dir: Path, dtype: str, device: str, lm_head_int8: bool = False,
                head_int8: bool = False, kernels: KernelPlan | None = None):
    if head_int8:
        raise InvalidArgument("int8 head projections are an EAGLE head's: Medusa's blocks stay in the model's dtype")
    from tandem.models.loader import parse_dtype
    from tandem.models.medusa import load_medusa_heads

    return load_medusa_heads(model_dir, target_dir, dtype=parse_dtype(dtype), device=device, lm_head_int8=lm_head_int8,
                             kernels=kernels)


def _eagle_engine() -> type:
    from draft_service.engine import DraftEngine

    return DraftEngine


def _medusa_engine() -> type:
    from draft_service.medusa_engine import MedusaDraftEngine

    return MedusaDraftEngine


def _describe_eagle(engine) -> tuple[int, str]:
    """A chain of the router's k, or an EAGLE-2 tree of tree_node_budget nodes."""
    config = engine.config
    return (config.tree_node_budget if config.is_tree else 0), config.shape


def _describe_medusa(engine) -> tuple[int, str]:
    return engine.max_draft_tokens, engine.shape


@dataclass(frozen=True, slots=True)
class DraftMethod:
    """load: the head loader (head folder, target folder, dtype, device, int8 flags, CPU kernel
    plan or None); engine: the engine class (draft_service.protocol.DraftEngine), built as
    engine(config, head, peer, tracing=);
    describe: what the engine's Info says, (draft tokens per sequence per step, 0 = the router's
    k; shape); default_shape: a deployment's shape when it names none."""

    load: Callable
    engine: Callable[[], type]
    describe: Callable[[object], tuple[int, str]]
    default_shape: str
    summary: str


DRAFT_METHODS = {
    # A chain by default: a tree costs a draft forward per depth over the whole frontier, worth
    # it where drafting is cheap next to verifying (a GPU; `tandem up` gives it the device's).
    "eagle": DraftMethod(load_eagle, _eagle_engine, _describe_eagle, "chain",
                         "an EAGLE-1/2 or EAGLE-3 head with its own KV cache; chains or dynamic trees"),
    # Its static tree costs no more than a chain (one heads pass).
    "medusa": DraftMethod(load_medusa, _medusa_engine, _describe_medusa, "tree",
                          "Medusa heads on the target's last hidden state, no KV cache; static trees"),
}


def draft_method(name: str) -> DraftMethod:
    if name not in DRAFT_METHODS:
        raise InvalidArgument(f"draft method {name!r} is not one of {sorted(DRAFT_METHODS)}")
    return DRAFT_METHODS[name]

