"""`tandem bench --mode spec`: its flags, its frozen config, and the modes (rows) it compares."""

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.bench.services import Devices, StackSpec
from tandem.models.heads import EAGLE_HEAD as DEFAULT_EAGLE_HEAD
from tandem.models.heads import MEDUSA_HEAD as DEFAULT_MEDUSA_HEAD
from tandem.models.heads import CPU_SHAPE, GPU_SHAPE, device_shape_flags

TEMPERATURES = (0.0, 1.0)
ROWS = ("hf_generate", "hf_prompt_lookup", "tandem_plain", "tandem_ngram", "tandem_suffix", "eagle_chain", "eagle_tree",
        "medusa")  # report order


def add_spec_flags(p) -> None:
    p.add_argument("--eagle-head", default=None, help=f"EAGLE head folder (default: {DEFAULT_EAGLE_HEAD})")
    p.add_argument("--medusa-head", default=None, help=f"Medusa head folder (default: {DEFAULT_MEDUSA_HEAD})")
    p.add_argument("--spec-draft-length", type=int, default=None,
                   help=f"k: chain length, tree depth at most (default: the device's, CPU {CPU_SHAPE.k} / GPU {GPU_SHAPE.k})")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="EAGLE tree: frontier nodes and children per depth (default: the device's,"
                        f" CPU {CPU_SHAPE.tree_top_k} / GPU {GPU_SHAPE.tree_top_k})")
    p.add_argument("--tree-node-budget", type=int, default=None,
                   help="trees: draft tokens per step (EAGLE: its most probable nodes; Medusa: the first nodes of its"
                        f" tree; default: the device's, CPU {CPU_SHAPE.tree_node_budget} / GPU {GPU_SHAPE.tree_node_budget})")
    p.add_argument("--spec-disable-batch-size", type=int, default=None,
                   help="the routers' --spec-disable-batch-size (default: the device's, as tandem up)")
    p.add_argument("--lookup-tokens", type=int, default=10,
                   help="transformers' prompt_lookup_num_tokens (the value its documentation uses)")
    p.add_argument("--seed", type=int, default=0, help="temperature 1: transformers' batch i samples after torch.manual_seed(seed + i); tandem's requests are unseeded (speculative sampling)")
    p.add_argument("--temperatures", type=_floats, default=TEMPERATURES,
                   help="comma-separated sampling temperatures, one cell each (default 0,1)")
    p.add_argument("--rows", type=_rows, default=ROWS,
                   help=f"--mode spec: comma-separated rows to run, of {','.join(ROWS)} (default: all; ratios"
                        " need tandem_plain and hf_generate in the run)")


def _rows(text: str) -> tuple[str, ...]:
    rows = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        raise argparse.ArgumentTypeError(f"unknown rows {unknown}; rows are {', '.join(ROWS)}")
    return rows


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t.strip())


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    dtype: str
    max_tokens: int
    concurrency: int
    threads: int
    seed: int
    temperatures: tuple[float, ...]
    rows: tuple[str, ...]  # the modes to run (ROWS); the others are reported as not run
    eagle_head: Path | None  # None: build a tiny random one (--reduced)
    medusa_head: Path | None
    spec_draft_length: int
    tree_top_k: int
    tree_node_budget: int
    spec_disable_batch_size: int
    lookup_tokens: int
    out: Path
    reduced: bool
    devices: Devices

    @property
    def batches(self) -> tuple[int, ...]:
        return (1, self.concurrency) if self.concurrency > 1 else (1,)


def spec_config(args) -> SpecBenchConfig:
    """Heads not named take the shipped defaults, or under --reduced tiny random ones; shape flags
    not given, the shape `tandem up` gives the target's device."""
    def head(flag, default):
        return Path(flag) if flag else (None if args.reduced else default)

    args = argparse.Namespace(**{**vars(args), **device_shape_flags(args)})
    return SpecBenchConfig(
        dtype=args.dtype, max_tokens=args.max_tokens, concurrency=args.concurrency, threads=args.threads,
        seed=args.seed, temperatures=tuple(args.temperatures), rows=tuple(args.rows),
        eagle_head=head(args.eagle_head, DEFAULT_EAGLE_HEAD), medusa_head=head(args.medusa_head, DEFAULT_MEDUSA_HEAD),
        spec_draft_length=args.spec_draft_length,
        tree_top_k=args.tree_top_k, tree_node_budget=args.tree_node_budget,
        spec_disable_batch_size=args.spec_disable_batch_size, lookup_tokens=args.lookup_tokens,
        out=Path(args.out), reduced=args.reduced, devices=Devices.from_args(args),
    )


@dataclass(frozen=True, slots=True)
class Mode:
    """One row of the comparison: in the bench process (transformers) or a service stack."""

    name: str
    label: str
    how: str  # what exactly runs, and what "batch" means for it
    stack: StackSpec | None = None  # tandem modes
    lookup_tokens: int = 0  # transformers: prompt-lookup decoding when > 0
    skipped: str = ""  # why the whole mode does not run

    @property
    def speculative(self) -> bool:
        return self.lookup_tokens > 0 or bool(self.stack and (self.stack.draft or "--local-draft" in self.stack.router))


def plan_modes(cfg: SpecBenchConfig, eagle: Path, medusa: Path) -> list[Mode]:
    """The rows (ROWS), in report order; a row left out of --rows or without its head folder is
    skipped with the reason."""
    router_flags = ("--spec-draft-length", str(cfg.spec_draft_length),
                    "--spec-disable-batch-size", str(cfg.spec_disable_batch_size))
    services = "target, draft and router as processes; batch B: B concurrent Generate streams"
    budget = ("--tree-node-budget", str(cfg.tree_node_budget))
    tree = ("--shape", "tree", "--tree-top-k", str(cfg.tree_top_k), *budget)

    def draft(name, label, method, head, shape_flags, how):
        if not (head / "config.json").exists():
            return Mode(name, label, how, skipped=f"skipped: no head at {head}")
        args = ("--method", method, "--draft-model", str(head), *shape_flags)
        return Mode(name, label, how, StackSpec(draft=args, router=router_flags))

    modes = [
        Mode("hf_generate", "transformers generate", "transformers generate() in the bench process;"
             " batch B: one left-padded batch of B prompts"),
        Mode("hf_prompt_lookup", "transformers prompt lookup",
             f"transformers generate(prompt_lookup_num_tokens={cfg.lookup_tokens}) in the bench process;"
             " batch B: one left-padded batch (transformers refuses B > 1)", lookup_tokens=cfg.lookup_tokens),
        Mode("tandem_plain", "tandem plain", "target and router as processes (--draft none); batch B: B concurrent"
             " Generate streams", StackSpec(router=router_flags)),
        Mode("tandem_ngram", "tandem n-gram lookup", "target and router as processes, the router drafting by prompt"
             f" lookup (--local-draft ngram), chains of k = {cfg.spec_draft_length}; no head",
             StackSpec(router=(*router_flags, "--local-draft", "ngram"))),
        Mode("tandem_suffix", "tandem suffix trees", "target and router as processes, the router drafting suffix"
             f" trees of k = {cfg.spec_draft_length} nodes (--local-draft suffix); no head",
             StackSpec(router=(*router_flags, "--local-draft", "suffix"))),
        draft("eagle_chain", "tandem EAGLE chain", "eagle", eagle, ("--shape", "chain"),
              f"{services}; EAGLE chain of k = {cfg.spec_draft_length}"),
        draft("eagle_tree", "tandem EAGLE tree", "eagle", eagle, tree,
              f"{services}; EAGLE-2 tree, top-k {cfg.tree_top_k}, {cfg.tree_node_budget} nodes,"
              f" depth <= {cfg.spec_draft_length}"),
        draft("medusa", "tandem Medusa", "medusa", medusa, ("--shape", "tree", *budget),
              f"{services}; Medusa static tree (the head's own), its first {cfg.tree_node_budget} nodes,"
              f" depth <= {cfg.spec_draft_length}"),
    ]
    return [m if m.name in cfg.rows or m.skipped else replace(m, skipped="skipped: not in --rows") for m in modes]
