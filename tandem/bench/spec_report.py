"""The speculation bench's report: rows with their ratios, the machine's facts, and the files
(JSON, markdown table, PNG plots) written into the results folder."""

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from tandem.bench.machine import machine_facts
from tandem.bench.spec_modes import SpecBenchConfig
from tandem.models.heads import head_quant, lm_head_quant

NOTES = (
    "Every request generates exactly max_tokens tokens (eos ignored), in every mode.",
    "transformers runs in the bench process; its batch B is one left-padded batch of B prompts."
    " tandem's batch B is B concurrent Generate streams to the router (target, draft and router as"
    " processes).",
    "transformers refuses prompt lookup for batches of more than one prompt: those rows are skipped"
    " with its error.",
    "Accepted length: tokens per verify step, the bonus token included (tandem: from each request's"
    " Usage; transformers: tokens per forward pass and sequence, so plain generate is 1).",
    "Temperature 1: full distribution (no top-k / top-p); transformers' batch i seeded with seed + i,"
    " tandem's requests unseeded (speculative sampling, as unseeded requests are served; a seeded one"
    " draws keyed and is verified against its own draw); outputs differ between modes.",
    "Time split from the router's Stats: target = the target's compute in its steps; draft = the"
    " draft's time in its calls (its wait for the target's hidden states included); RPC = call wall"
    " time less the service's own time; router and client = the rest of the wall time.",
)


def _ratios(rows: list[dict]) -> None:
    """Adds each ok row's tokens/s over tandem plain's and transformers generate's in its cell."""
    base = {(r["mode"], r["temperature"], r["batch"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        for key, mode in (("ratio_to_tandem_plain", "tandem_plain"), ("ratio_to_transformers", "hf_generate")):
            b = base.get((mode, r["temperature"], r["batch"]))
            r[key] = round(r["tokens_per_s"] / b["tokens_per_s"], 4) if b else None


def build_report(cfg: SpecBenchConfig, model: Path, prompts: int, modes, rows: list[dict],
                 duration_s: float, load_before: float) -> dict:
    _ratios(rows)
    return {
        "mode": "spec",
        "command": "tandem " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "tandem bench --mode spec",
        "model": str(model),
        "model_name": "tiny random model" if cfg.reduced else f"{model.parent.name}/{model.name}",
        "dtype": cfg.dtype,
        "devices": cfg.devices.record(),
        "prompts": prompts,
        "max_tokens": cfg.max_tokens,
        "batches": sorted({r["batch"] for r in rows}),
        "seed": cfg.seed,
        "reduced": cfg.reduced,
        "settings": {"spec_draft_length": cfg.spec_draft_length, "tree_top_k": cfg.tree_top_k,
                     "tree_node_budget": cfg.tree_node_budget, "spec_disable_batch_size": cfg.spec_disable_batch_size,
                     "lookup_tokens": cfg.lookup_tokens,
                     # the drafts' lm_head and EAGLE's own projections as the draft services resolve
                     # --draft-lm-head-quant / --draft-head-quant auto
                     "draft_lm_head_quant": lm_head_quant("auto", cfg.devices.draft),
                     "eagle_head_quant": head_quant("auto", cfg.devices.draft, "eagle")},
        "modes": [{"name": m.name, "label": m.label, "how": m.how, "skipped": m.skipped or None} for m in modes],
        "duration_s": round(duration_s, 1),
        "machine": machine_facts(cfg.threads),
        "load_average_1m_before": round(load_before, 2),  # above ~0.5: something else was running
        "notes": list(NOTES),
        "rows": rows,
    }


def write_results(out: Path, report: dict, name: str = "spec") -> dict[str, Path]:
    """<name>-<stamp>.{json,md}, <name>-<stamp>-acceptance.png and -throughput.png, each copied to
    <name>-latest*; --reduced writes <name>-reduced-* so that it never replaces a real run's files."""
    from tandem.bench.plots import plot_acceptance, plot_throughput
    from tandem.bench.report import markdown_summary

    out.mkdir(parents=True, exist_ok=True)
    prefix = f"{name}-reduced-" if report["reduced"] else f"{name}-"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    written = {
        "json": out / f"{prefix}{stamp}.json",
        "markdown": out / f"{prefix}{stamp}.md",
        "acceptance": out / f"{prefix}{stamp}-acceptance.png",
        "throughput": out / f"{prefix}{stamp}-throughput.png",
    }
    written["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    written["markdown"].write_text(markdown_summary(report))
    plot_acceptance(report, written["acceptance"])
    plot_throughput(report, written["throughput"])
    for path in list(written.values()):
        shutil.copyfile(path, out / path.name.replace(stamp, "latest"))
    print(written["markdown"].read_text())
    print(f"results written to {out}/{prefix}{stamp}.* and {prefix}latest.*")
    return written
