"""`tandem bench --mode spec --reduced`: every mode on a tiny model with tiny random heads, through
the real services as processes; checks the files it writes, not its speeds."""

import json
import math

from PIL import Image

from tandem.bench.spec_modes import ROWS
from tests.e2e.conftest import tandem_cli

MODES = ROWS  # every row the bench knows
PROMPTS, TOKENS = 2, 8


def _close(a: float, b: float, tol: float = 2e-3) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def test_bench_spec_reduced_writes_rows_plots_and_table(tmp_path):
    # CPU defaults draft nothing in steps decoding 2 sequences (CPU_SHAPE): whether a batch-2 row
    # then verifies any draft would hang on timing, so batch 2 drafts in every step here.
    out = tandem_cli("bench", "--mode", "spec", "--reduced", "--questions", str(PROMPTS), "--max-tokens", str(TOKENS),
                     "--concurrency", "2", "--device", "cpu", "--spec-disable-batch-size", "0",
                     "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "spec-reduced-latest.json").read_text())
    assert report["machine"]["cores"] >= 1 and report["prompts"] == PROMPTS
    assert report["devices"] == {"target": "cpu", "draft": "cpu", "cuda_graphs": False} and report["machine"]["gpus"] == []
    assert report["settings"]["spec_disable_batch_size"] == 0
    rows = {(r["mode"], r["temperature"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(m, t, b) for m in MODES for t in (0.0, 1.0) for b in (1, 2)}
    for key, r in rows.items():
        if r["status"] == "skipped":
            assert r["reason"].startswith("skipped:"), r
            continue
        assert r["status"] == "ok" and r["completion_tokens"] == PROMPTS * TOKENS, r
        for name in ("seconds", "tokens_per_s", "mean_accepted_length", "ratio_to_tandem_plain", "ratio_to_transformers"):
            assert math.isfinite(r[name]) and r[name] > 0, (key, name, r)
        assert _close(r["tokens_per_s"], r["completion_tokens"] / r["seconds"])
        assert r["requests"] == PROMPTS and 0 <= r["looping_requests"] <= PROMPTS
        mode, t, b = key
        assert _close(r["ratio_to_tandem_plain"], r["tokens_per_s"] / rows["tandem_plain", t, b]["tokens_per_s"])
        assert _close(r["ratio_to_transformers"], r["tokens_per_s"] / rows["hf_generate", t, b]["tokens_per_s"])
    # transformers refuses prompt lookup for a batch; every other row ran.
    assert {k for k, r in rows.items() if r["status"] == "skipped"} == {("hf_prompt_lookup", t, 2) for t in (0.0, 1.0)}
    assert "refuses batches" in rows["hf_prompt_lookup", 0.0, 2]["reason"]
    for t in (0.0, 1.0):
        for b in (1, 2):
            assert rows["tandem_plain", t, b]["ratio_to_tandem_plain"] == 1.0
            assert rows["hf_generate", t, b]["mean_accepted_length"] == 1.0
            _check_speculative(rows, t, b)
    # greedy outputs are the same in every tandem mode, so are the requests that loop
    assert len({rows[m, 0.0, 1]["looping_requests"] for m in MODES if not m.startswith("hf")}) == 1
    for name in ("acceptance", "throughput"):
        with Image.open(tmp_path / f"spec-reduced-latest-{name}.png") as png:
            assert png.format == "PNG" and png.width > 100 and png.height > 100
            png.verify()
    table = (tmp_path / "spec-reduced-latest.md").read_text()
    assert "| mode |" in table and "| tandem EAGLE chain |" in table and "refuses batches" in table


def _check_speculative(rows: dict, t: float, b: int) -> None:
    """Accepted length adds up from its positions; the time split covers the wall time."""
    plain = rows["tandem_plain", t, b]
    assert plain["acceptance_by_depth"] is None and plain["time_split"]["fractions"]["draft"] == 0
    for mode in ("eagle_chain", "eagle_tree", "medusa"):
        r = rows[mode, t, b]
        assert r["verify_steps"] > 0 and len(r["acceptance_by_depth"]) >= 1
        assert all(0 <= a <= 1 for a in r["acceptance_by_depth"])
        assert _close(r["mean_accepted_length"], 1 + sum(r["acceptance_by_depth"]), 5e-3)
        split = r["time_split"]
        assert split["steps"] > 0 and split["fractions"]["draft"] > 0
        assert all(math.isfinite(v) and v >= 0 for v in split["fractions"].values()), split
        assert _close(sum(split["fractions"].values()), 1.0, 0.01), split


def test_bench_shapes_reduced_compares_draft_shapes_to_plain(tmp_path):
    out = tandem_cli("bench", "--mode", "shapes", "--reduced", "--questions", str(PROMPTS), "--max-tokens", str(TOKENS),
                     "--shapes", "chain:2,tree:1:2:2", "--temperatures", "0", "--concurrency", "1",
                     "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "shapes-reduced-latest.json").read_text())
    assert report["mode"] == "shapes" and report["settings"]["shapes"] == "chain:2,tree:1:2:2"
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["tandem_plain", "eagle_chain_2", "eagle_tree_1_2_2"]
    assert all(r["status"] == "ok" and r["completion_tokens"] == PROMPTS * TOKENS and r["batch"] == 1
               for r in rows.values())
    assert rows["tandem_plain"]["ratio_to_tandem_plain"] == 1.0
    assert rows["tandem_plain"]["acceptance_by_depth"] is None
    for name in ("eagle_chain_2", "eagle_tree_1_2_2"):
        r = rows[name]
        assert r["verify_steps"] > 0 and len(r["acceptance_by_depth"]) == 2  # the deepest shape's k
        assert _close(r["ratio_to_tandem_plain"], r["tokens_per_s"] / rows["tandem_plain"]["tokens_per_s"])
    assert rows["eagle_tree_1_2_2"]["acceptance_by_depth"][1] == 0  # a depth-1 tree never reaches 2
    assert "| tree depth<=1 top-2 2 nodes |" in (tmp_path / "shapes-reduced-latest.md").read_text()
