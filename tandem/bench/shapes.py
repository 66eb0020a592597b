"""`tandem bench --mode shapes`: which draft shape pays on this machine. Plain decoding and one
EAGLE head in several shapes (chains of k; trees of depth k, top-k children, a node budget), each
a real target + draft + router stack, side by side on MT-bench first turns, taking turns prompt
by prompt (the spec bench's rotation). Per shape: tokens/s and its ratio to plain, the accepted
length, acceptance by draft position and the time split. `tandem up`'s CPU default
(tandem.models.heads) was chosen from this.
"""

import os
import time
from dataclasses import dataclass, replace

from draft_service.config import LM_HEAD_QUANTS
from tandem.bench.services import StackSpec
from tandem.bench.spec_modes import Mode
from tandem.errors import InvalidArgument
from tandem.models.heads import DraftShape

DEFAULT_SHAPES = "chain:1,chain:2,chain:3,tree:1:3:3,tree:2:2:4"


QUANTS = ("auto", *LM_HEAD_QUANTS)  # --draft-lm-head-quant, --draft-head-quant


@dataclass(frozen=True, slots=True)
class ShapeRow:
    """One stack of the bench: a draft shape, the draft's lm_head (--draft-lm-head-quant) and
    the head's own projections (--draft-head-quant)."""

    shape: DraftShape
    lm_head_quant: str = "auto"
    head_quant: str = "auto"


def add_shapes_flag(p) -> None:
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="--mode shapes: comma-separated chain:K or tree:K:TOP_K:NODE_BUDGET, each optionally"
                        " @LM_HEAD or @LM_HEAD/HEAD, each int8 / none / auto (the draft's --draft-lm-head-quant and"
                        " --draft-head-quant; default auto) (default %(default)s);"
                        " the head is --eagle-head; --temperatures 0 --concurrency 1 for greedy batch 1 alone")


def parse_shapes(text: str) -> list[ShapeRow]:
    rows = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        spec, _, quants = item.partition("@")
        kind, *numbers = spec.split(":")
        try:
            values = [int(n) for n in numbers]
        except ValueError:
            values = []
        lm_head, _, head = quants.partition("/")
        if not {lm_head, head} <= {"", *QUANTS} or (quants and not lm_head):
            raise InvalidArgument(f"--shapes: {item!r}: after @ come LM_HEAD or LM_HEAD/HEAD, each one of {', '.join(QUANTS)}")
        quant = {"lm_head_quant": lm_head or "auto", "head_quant": head or "auto"}
        if kind == "chain" and len(values) == 1 and values[0] >= 1:
            rows.append(ShapeRow(DraftShape("chain", values[0]), **quant))
        elif kind == "tree" and len(values) == 3 and min(values) >= 1:
            rows.append(ShapeRow(DraftShape("tree", *values), **quant))
        else:
            raise InvalidArgument(f"--shapes: {item!r} is neither chain:K nor tree:K:TOP_K:NODE_BUDGET")
    if not rows:
        raise InvalidArgument("--shapes: no shape given")
    return rows


def shape_label(row: ShapeRow) -> str:
    s = row.shape
    label = f"chain k={s.k}" if s.shape == "chain" else f"tree depth<={s.k} top-{s.tree_top_k} {s.tree_node_budget} nodes"
    label += "" if row.lm_head_quant == "auto" else f", lm_head {row.lm_head_quant}"
    return label if row.head_quant == "auto" else f"{label}, head {row.head_quant}"


def shape_modes(head, rows: list[ShapeRow]) -> list[Mode]:
    """Plain decoding first (the ratios' base), then a stack per shape."""
    plain = Mode("tandem_plain", "tandem plain", "target and router (--draft none)",
                 StackSpec(router=("--spec-draft-length", "1")))
    modes = [plain]
    for row in rows:
        s = row.shape
        draft = ("--method", "eagle", "--draft-model", str(head), "--shape", s.shape,
                 "--draft-lm-head-quant", row.lm_head_quant, "--draft-head-quant", row.head_quant)
        if s.shape == "tree":
            draft += ("--tree-top-k", str(s.tree_top_k), "--tree-node-budget", str(s.tree_node_budget))
        name = f"eagle_{s.shape}_{s.k}" + (f"_{s.tree_top_k}_{s.tree_node_budget}" if s.shape == "tree" else "")
        name += "" if row.lm_head_quant == "auto" else f"_{row.lm_head_quant}"
        name += "" if row.head_quant == "auto" else f"_head_{row.head_quant}"
        modes.append(Mode(name, shape_label(row), f"EAGLE {shape_label(row)}",
                          StackSpec(draft=draft, router=("--spec-draft-length", str(s.k)))))
    return modes


def run_shapes_bench(args) -> int:
    from transformers import AutoTokenizer

    from tandem.bench.inputs import bench_model, bench_prompts
    from tandem.bench.spec import _heads, measure
    from tandem.bench.spec_modes import spec_config
    from tandem.bench.spec_report import build_report, write_results

    shapes = parse_shapes(args.shapes)
    cfg = replace(spec_config(args), spec_draft_length=max(r.shape.k for r in shapes))  # positions to report
    load = os.getloadavg()[0]
    model = bench_model(args)
    eagle, _ = _heads(cfg, model)
    prompts = bench_prompts(args, AutoTokenizer.from_pretrained(model))
    modes = shape_modes(eagle, shapes)
    print(f"bench shapes: {len(prompts)} prompts x {cfg.max_tokens} tokens, {len(shapes)} shapes, {model}", flush=True)
    started = time.perf_counter()
    rows = measure(cfg, model, prompts, modes)
    report = build_report(cfg, model, len(prompts), modes, rows, time.perf_counter() - started, load)
    report.update(mode="shapes", settings={"shapes": args.shapes, "eagle_head": str(eagle)})
    write_results(cfg.out, report, name="shapes")
    return 0
