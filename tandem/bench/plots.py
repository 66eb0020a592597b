"""PNG plots of a speculation bench report (matplotlib, the `bench` extra; Agg: no display)."""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cell(row: dict) -> str:
    return f"{'greedy' if row['temperature'] == 0 else 'temp ' + format(row['temperature'], 'g')}, batch {row['batch']}"


def plot_acceptance(report: dict, path: Path) -> None:
    """Per cell, one line per speculative tandem mode: the share of verify steps whose accepted
    drafts reached each draft position."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cells = list(dict.fromkeys(_cell(r) for r in report["rows"]))
    cols = min(2, len(cells))  # batches side by side, a temperature per line
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.4 * rows + 0.6), sharey=True, squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        for row in report["rows"]:
            if _cell(row) == cell and row["status"] == "ok" and row.get("acceptance_by_depth"):
                rates = row["acceptance_by_depth"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=row["label"])
        ax.set_title(cell)
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("verify steps accepting it")
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
    fig.suptitle("Acceptance by draft position")
    fig.tight_layout(rect=(0, 0.6 / (3.4 * rows + 0.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(report: dict, path: Path) -> None:
    """Tokens/s per mode, a bar per cell (batch 1 / batch B, greedy / temperature 1); a skipped
    row leaves its bar out, marked n/a."""
    plt = _pyplot()
    modes = list(dict.fromkeys(r["label"] for r in report["rows"]))
    cells = list(dict.fromkeys(_cell(r) for r in report["rows"]))
    by = {(r["label"], _cell(r)): r for r in report["rows"]}
    width = 0.8 / len(cells)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.5 * len(modes)), 4.2))
    for j, cell in enumerate(cells):
        xs = [i + (j - (len(cells) - 1) / 2) * width for i in range(len(modes))]
        rows = [by.get((m, cell)) for m in modes]
        heights = [r["tokens_per_s"] if r and r["status"] == "ok" else 0.0 for r in rows]
        ax.bar(xs, heights, width, label=cell)
        for x, r in zip(xs, rows):
            if not r or r["status"] != "ok":
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize="x-small", rotation=90)
    ax.set_xticks(range(len(modes)), modes, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel("completion tokens / s")
    ax.set_title("Throughput by mode")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
