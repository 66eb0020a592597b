"""The markdown summary of a speculation bench report (for docs/benchmarks.md)."""

from tandem.loops import LOOP_RULE


def _cell(row: dict) -> str:
    return f"{'greedy' if row['temperature'] == 0 else 'temp ' + format(row['temperature'], 'g')}, batch {row['batch']}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _throughput(row: dict) -> str:
    if row["status"] != "ok":
        return "skipped"
    return (f"{row['tokens_per_s']:.1f} ({_ratio(row['ratio_to_tandem_plain'])} plain,"
            f" {_ratio(row['ratio_to_transformers'])} HF)")


def _split(row: dict) -> str:
    split = row.get("time_split")
    if not split:
        return "-"
    f = split["fractions"]
    rpc = f["target_rpc"] + f["draft_rpc"]
    return (f"{f['target']:.0%} / {f['draft']:.0%} / {rpc:.0%} / {f['router_and_client']:.0%}"
            f" ({split['mean_step_ms']:.1f} ms)")


def markdown_summary(report: dict) -> str:
    rows = report["rows"]
    cells = list(dict.fromkeys(_cell(r) for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], _cell(r)): r for r in rows}
    m = report["machine"]
    lines = [
        f"`{report['command']}`: {report['prompts']} MT-bench first turns x {report['max_tokens']} tokens"
        f" ({report['model_name']}, {report['dtype']}); {m['cpu']}, {m['cores']} cores,"
        f" {m['torch_threads']} torch threads, load average {report['load_average_1m_before']} before; {m['date']}.",
        "",
        "Tokens/s (ratio to tandem plain and to transformers generate, same temperature and batch):",
        "",
        "| mode | " + " | ".join(cells) + " |",
        "|---|" + "---|" * len(cells),
    ]
    lines += [f"| {label} | " + " | ".join(_throughput(by[label, c]) for c in cells) + " |" for label in labels]
    lines += [
        "",
        "Mean accepted length (tokens per verify step, bonus included), acceptance by draft position"
        " (share of verify steps reaching it), and the time split target / draft / RPC / router and"
        f" client (wall time per target step), and the requests whose completion loops ({LOOP_RULE}; a loop"
        " is easy to draft):",
        "",
        "| mode | cell | accepted length | by position | time split | loops |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok" or r["mode"] == "hf_generate":
            continue
        depth = ", ".join(f"{a:.2f}" for a in r["acceptance_by_depth"]) if r["acceptance_by_depth"] else "-"
        loops = f"{r['looping_requests']} of {r['requests']}" if "requests" in r else "-"
        lines.append(f"| {r['label']} | {_cell(r)} | {r['mean_accepted_length']:.2f} | {depth} | {_split(r)} | {loops} |")
    skipped = sorted({f"{r['label']} ({_cell(r)}): {r['reason']}" for r in rows if r["status"] != "ok"})
    if skipped:
        lines += ["", "Not measured:", "", *[f"- {s}" for s in skipped]]
    lines += ["", "Notes:", "", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines) + "\n"
