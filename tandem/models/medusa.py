"""Medusa-1 draft heads (Cai et al., FasterDecoding/Medusa `medusa/model/medusa_model.py`):
H small heads on the target's last hidden state, each predicting one token further ahead.

Words:
- feature f_t: the target's final-norm hidden state at position t (what LlamaModel.forward
  returns, and what the target streams to the draft); the target's lm_head(f_t) predicts t_{t+1}.
- head i (0-based): predicts t_{t+i+2} from f_t. With t the last position in the target's KV and
  t_{t+1} the pending token (sampled, not yet in the KV), head 0 proposes the token after the
  pending one: depth 1 of the draft tree whose root is the pending token.
- residual block: x + SiLU(W x + b), `medusa_num_layers` of them per head, then the head's own
  lm_head [V, D] or, when the checkpoint has none, the target's (shared).

Public format: a folder with `config.json` (`medusa_num_heads`, `medusa_num_layers`, optionally
`hidden_size`, `vocab_size`: Medusa-1 configs lack them, the target's are used) and the weights
as `model.safetensors` or `pytorch_model.bin` (Medusa-1's own `medusa_lm_head.safetensors` /
`medusa_lm_head.pt` too), keys in nn.Linear's [out, in] layout:

    medusa_head.{i}.{j}.linear.weight [D, D], medusa_head.{i}.{j}.linear.bias [D]   j < L
    medusa_head.{i}.{L}.weight [V, D]        optional: absent in every head = the target's lm_head

Other keys (a Medusa-2 file also holds the base model's weights) are ignored; Medusa-1's legacy
files name the keys without the `medusa_head.` prefix, which is added on reading.

A folder may also hold `d2t.safetensors`, EAGLE-3's map of a pruned draft vocabulary (not part
of Medusa's format): the heads then score only those tokens, the rest at -inf. Each head's
lm_head pass is most of a Medusa draft's cost, and any vocabulary keeps verification lossless.

And `medusa_choices.json`, the head's own static tree: a JSON list of rank paths listed best
first (`tandem train-draft` fits it on measured ranks), so that every prefix of the list is a
tree and the first N nodes are the tree to verify when N draft tokens a step are allowed.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.errors import InvalidArgument
from tandem.models.config import ModelConfig
from tandem.models.eagle_io import read_draft_vocab, read_tensors, widen_vocab
from tandem.models.kernel_plan import DEFAULT_PLAN, KernelPlan
from tandem.models.linear import Int8Linear, Linear, make_head_projection, with_plan

log = logging.getLogger(__name__)
PREFIX = "medusa_head."
# Read in this order; the first that exists wins (pytorch_model.bin first, as the EAGLE loader).
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors", "medusa_lm_head.safetensors", "medusa_lm_head.pt")
SAVE_FILES = {"bin": "pytorch_model.bin", "safetensors": "model.safetensors"}
CHOICES_FILE = "medusa_choices.json"  # the head's own static tree, best first


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    hidden_size: int
    vocab_size: int

    @staticmethod
    def from_dict(raw: dict, target: ModelConfig) -> "MedusaConfig":
        if "medusa_num_heads" not in raw:
            raise InvalidArgument("Medusa config.json lacks medusa_num_heads")
        config = MedusaConfig(
            num_heads=int(raw["medusa_num_heads"]),
            num_layers=int(raw.get("medusa_num_layers", 1)),
            hidden_size=int(raw.get("hidden_size", target.hidden_size)),
            vocab_size=int(raw.get("vocab_size", target.vocab_size)),
        )
        if config.num_heads <= 0 or config.num_layers < 0:
            raise InvalidArgument(f"Medusa config: medusa_num_heads {config.num_heads} must be > 0, medusa_num_layers >= 0")
        for name in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(config, name), getattr(target, name)
            if ours != theirs:
                raise InvalidArgument(f"Medusa {name} {ours} does not match the target's {theirs}")
        return config

    def to_dict(self) -> dict:
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


class MedusaHeads:
    """The heads, batched: weights stacked over heads and stored transposed, [in, out]."""

    def __init__(
        self,
        config: MedusaConfig,
        blocks: torch.Tensor,  # [H, L, D, D]: block j of head i is x + silu(x @ blocks[i, j] + bias[i, j])
        biases: torch.Tensor,  # [H, L, D]
        lm_heads: torch.Tensor | None,  # [H, D, V']: each head's own; None: `shared_lm_head`
        shared_lm_head: Linear | Int8Linear | None = None,  # the target's lm_head, [V', D] as it stores it
        vocab_ids: torch.Tensor | None = None,  # [V'] int64: the pruned vocabulary's target ids
    ):
        h, n, d = config.num_heads, config.num_layers, config.hidden_size
        self.config, self.vocab_ids = config, vocab_ids
        v = self.draft_vocab_size
        assert blocks.shape == (h, n, d, d) and biases.shape == (h, n, d), (blocks.shape, biases.shape)
        assert (lm_heads is None) != (shared_lm_head is None), "exactly one of lm_heads, shared_lm_head"
        assert lm_heads is None or lm_heads.shape == (h, d, v), lm_heads.shape
        assert shared_lm_head is None or shared_lm_head.weight.shape == (v, d), shared_lm_head.weight.shape
        self.blocks, self.biases = blocks, biases
        self.feature_layers: tuple[int, ...] = ()  # they read the target's final-norm hidden state
        self.feature_width = d
        self.lm_heads, self.shared_lm_head = lm_heads, shared_lm_head
        self.dtype = blocks.dtype

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def draft_vocab_size(self) -> int:
        """The tokens the heads rank: the pruned vocabulary's, else the target's."""
        return self.config.vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [S, D] final-norm target features -> logits [S, H, V] in fp32; row [s, i]
        scores the token i + 2 positions after hidden[s]'s position. num_heads: only the first
        H of them (a tree no deeper than H reads no others; each costs an lm_head pass)."""
        assert hidden.dim() == 2 and hidden.shape[1] == self.config.hidden_size, hidden.shape
        heads, rows = num_heads or self.config.num_heads, hidden.shape[0]
        assert 0 < heads <= self.config.num_heads, (heads, self.config.num_heads)
        x = hidden.to(self.dtype)[None].expand(heads, rows, -1)  # [H, S, D]
        for j in range(self.config.num_layers):
            x = x + F.silu(torch.baddbmm(self.biases[:heads, j, None, :], x, self.blocks[:heads, j]))
        if self.lm_heads is not None:
            out = torch.bmm(x, self.lm_heads[:heads])  # [H, S, V']
        else:
            out = self.shared_lm_head(x.reshape(heads * rows, -1)).view(heads, rows, -1)
        return widen_vocab(out.transpose(0, 1).float(), self.vocab_ids, self.config.vocab_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Public key names and layout; no lm_head keys when the heads share the target's."""
        state = {}
        for i in range(self.config.num_heads):
            for j in range(self.config.num_layers):
                state[f"{PREFIX}{i}.{j}.linear.weight"] = self.blocks[i, j].t().contiguous()
                state[f"{PREFIX}{i}.{j}.linear.bias"] = self.biases[i, j].clone()
            if self.lm_heads is not None:
                state[f"{PREFIX}{i}.{self.config.num_layers}.weight"] = self.lm_heads[i].t().contiguous()
        return state


def read_medusa_checkpoint(head_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the raw config.json, the Medusa tensors on the CPU, keys with the `medusa_head.` prefix)."""
    head_dir = Path(head_dir)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        raise InvalidArgument(f"Medusa head folder {head_dir} has no config.json")
    path = next((head_dir / n for n in WEIGHT_FILES if (head_dir / n).is_file()), None)
    if path is None:
        raise InvalidArgument(f"Medusa head folder {head_dir} has none of {list(WEIGHT_FILES)}")
    if path.suffix == ".safetensors":
        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not any(k.startswith(PREFIX) for k in state):  # Medusa-1's medusa_lm_head.*: "0.0.linear.weight"
        state = {PREFIX + k: v for k, v in state.items() if k[:1].isdigit()}
    return json.loads(config_path.read_text()), {k: v for k, v in state.items() if k.startswith(PREFIX)}


def build_medusa_heads(config: MedusaConfig, state: dict[str, torch.Tensor], dtype, device,
                       target_lm_head: torch.Tensor | None, vocab_ids: torch.Tensor | None = None,
                       lm_head_int8: bool = False, kernels: KernelPlan = DEFAULT_PLAN) -> MedusaHeads:
    """Checks every key and shape of a public state dict; target_lm_head [V, D] is used when
    the checkpoint has no lm_head of its own (and may be None when it has); vocab_ids: the
    target ids of a pruned vocabulary, whose rows of every lm_head are kept; lm_head_int8: the
    shared lm_head scores in int8 (CPU; heads with lm_heads of their own keep them as they are);
    kernels: the shared lm_head's CPU kernel plan (Medusa never times its own)."""
    d, v, n = config.hidden_size, config.vocab_size, config.num_layers
    expected = {}
    for i in range(config.num_heads):
        for j in range(n):
            expected[f"{PREFIX}{i}.{j}.linear.weight"] = (d, d)
            expected[f"{PREFIX}{i}.{j}.linear.bias"] = (d,)
    heads = [f"{PREFIX}{i}.{n}.weight" for i in range(config.num_heads)]
    own = [k for k in heads if k in state]
    if own and len(own) != len(heads):
        raise InvalidArgument(f"Medusa checkpoint has lm_head weights for {len(own)} of {len(heads)} heads")
    expected.update({k: (v, d) for k in own})
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InvalidArgument(
            f"Medusa checkpoint has unexpected weights {unexpected[:3]}"
            f" (medusa_num_heads {config.num_heads}, medusa_num_layers {n})"
        )
    for name, shape in expected.items():
        if name not in state:
            raise InvalidArgument(f"Medusa checkpoint lacks weight {name}")
        if tuple(state[name].shape) != shape:
            raise InvalidArgument(f"Medusa weight {name} has shape {list(state[name].shape)}, config wants {list(shape)}")

    def take(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype)

    blocks = torch.zeros(config.num_heads, n, d, d, dtype=dtype, device=device)
    biases = torch.zeros(config.num_heads, n, d, dtype=dtype, device=device)
    for i in range(config.num_heads):
        for j in range(n):
            blocks[i, j] = take(f"{PREFIX}{i}.{j}.linear.weight").t()
            biases[i, j] = take(f"{PREFIX}{i}.{j}.linear.bias")
    keep = slice(None) if vocab_ids is None else vocab_ids.cpu()  # rows of the CPU tensors read
    if own:
        lm_heads = torch.stack([state[k][keep].to(device=device, dtype=dtype).t() for k in heads]).contiguous()
        if lm_head_int8:
            log.warning("Medusa heads with lm_heads of their own keep them in %s: int8 applies to a shared lm_head", dtype)
        return MedusaHeads(config, blocks, biases, lm_heads, vocab_ids=vocab_ids)
    if target_lm_head is None:
        raise InvalidArgument("Medusa checkpoint has no lm_head weights and no target lm_head was given")
    shared = make_head_projection(target_lm_head[keep].to(device=device, dtype=dtype), lm_head_int8)
    return MedusaHeads(config, blocks, biases, None, with_plan(shared, kernels), vocab_ids)


def load_medusa_heads(head_dir: Path, target_dir: Path, *, dtype: torch.dtype, device="cpu",
                      lm_head_int8: bool = False, kernels: KernelPlan | None = None) -> MedusaHeads:
    """The heads of `head_dir` (public format); the target's lm_head when they have none.
    kernels: the CPU kernel plan (--cpu-kernels); None: DEFAULT_PLAN."""
    raw, state = read_medusa_checkpoint(head_dir)
    target = ModelConfig.from_folder(target_dir)
    config = MedusaConfig.from_dict(raw, target)
    shares = f"{PREFIX}0.{config.num_layers}.weight" not in state
    lm_head = target_lm_head(target, Path(target_dir)) if shares else None
    vocab_ids = read_draft_vocab(Path(head_dir), config.vocab_size, device)
    return build_medusa_heads(config, state, dtype, device, lm_head, vocab_ids, lm_head_int8,
                              kernels or DEFAULT_PLAN)


def target_lm_head(target: ModelConfig, target_dir: Path) -> torch.Tensor:
    """The target's lm_head [V, D], tied or not (the loader's rule)."""
    embed_key, head_key = "model.embed_tokens.weight", "lm_head.weight"
    found = read_tensors(target_dir, {embed_key, head_key})
    tied = target.tie_word_embeddings or head_key not in found
    key = embed_key if tied else head_key
    if key not in found:
        raise InvalidArgument(f"target checkpoint {target_dir} lacks weight {key}")
    return found[key]


def save_medusa_checkpoint(out_dir: Path, config: dict, state: dict[str, torch.Tensor], *, format: str = "safetensors") -> Path:
    """Writes config.json and the weights in the public format ("safetensors" or "bin");
    removes the other formats' weight files, which would shadow or be shadowed."""
    if format not in SAVE_FILES:
        raise InvalidArgument(f"format {format!r} is not one of {sorted(SAVE_FILES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in WEIGHT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    tensors = {k: t.detach().cpu().contiguous() for k, t in state.items()}
    path = out_dir / SAVE_FILES[format]
    if format == "bin":
        torch.save(tensors, path)
    else:
        save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def random_medusa_checkpoint(
    out_dir: Path, target_dir: Path, num_heads: int = 4, seed: int = 0, *,
    num_layers: int = 1, own_lm_head: bool = True, format: str = "safetensors",
) -> Path:
    """Random Medusa heads sized for the target, in the public format. Blocks scaled
    1/sqrt(D); own lm_heads start from the target's plus noise (Medusa initialises them as
    copies), so each head differs and a mixed-up head shows."""
    target = ModelConfig.from_folder(target_dir)
    d, v = target.hidden_size, target.vocab_size
    gen = torch.Generator().manual_seed(seed)
    state = {}
    base = target_lm_head(target, Path(target_dir)) if own_lm_head else None  # [V, D]
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{PREFIX}{i}.{j}.linear.weight"] = torch.randn(d, d, generator=gen) * d**-0.5
            state[f"{PREFIX}{i}.{j}.linear.bias"] = 0.1 * torch.randn(d, generator=gen)
        if base is not None:
            noise = torch.randn(v, d, generator=gen) * base.std()
            state[f"{PREFIX}{i}.{num_layers}.weight"] = base.float() + noise
    config = {"architectures": ["MedusaModel"], "medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
              "hidden_size": d, "vocab_size": v}
    return save_medusa_checkpoint(out_dir, config, state, format=format)


def read_head_choices(head_dir: Path | None) -> str | None:
    """The text of a head folder's own tree (CHOICES_FILE), None when it has none."""
    path = Path(head_dir) / CHOICES_FILE if head_dir else None
    return path.read_text().strip() if path is not None and path.is_file() else None


def write_head_choices(head_dir: Path, choices) -> Path:
    """Writes a static tree (rank paths, best first) as the head folder's own tree."""
    path = Path(head_dir) / CHOICES_FILE
    path.write_text(json.dumps([list(c) for c in choices]) + "\n")
    return path
