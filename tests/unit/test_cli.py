"""The `tandem` parser: building it (every subcommand's flags) imports no torch or
transformers, so `tandem health`, which compose's healthchecks run every few seconds, is fast."""

import subprocess
import sys
from pathlib import Path

from tandem.cli import build_parser

PROBE = "import sys, tandem.cli; tandem.cli.build_parser(); print(sorted({'torch', 'transformers'} & set(sys.modules)))"


def test_building_the_parser_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_metrics_ports_default_to_9400_9402(monkeypatch):
    for name in ("METRICS_PORT", "ROUTER_METRICS_PORT", "TARGET_METRICS_PORT", "DRAFT_METRICS_PORT"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)
    parser = build_parser()
    assert parser.parse_args(["router"]).metrics_port == 9400
    assert parser.parse_args(["target"]).metrics_port == 9401
    assert parser.parse_args(["draft"]).metrics_port == 9402
    up = parser.parse_args(["up"])
    assert (up.router_metrics_port, up.target_metrics_port, up.draft_metrics_port) == (9400, 9401, 9402)


def _up(*flags: str, monkeypatch):
    from tandem.launcher import resolve_up_draft

    for name in ("DRAFT", "DRAFT_MODEL", "SPEC_DRAFT_LENGTH", "MODEL", "DEVICE", "DRAFT_SHAPE", "TREE_TOP_K",
                 "TREE_NODE_BUDGET"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)
    return resolve_up_draft(build_parser().parse_args(["up", *flags]))


def test_up_serves_the_shipped_eagle_head_for_the_default_model(monkeypatch):
    from tandem.models.heads import EAGLE_HEAD

    args = _up(monkeypatch=monkeypatch)
    assert (args.draft, args.draft_model, args.spec_draft_length) == ("eagle", EAGLE_HEAD, 1)
    assert (args.shape, args.tree_top_k, args.tree_node_budget) == ("tree", 3, 3)  # CPU: one depth, 3 siblings
    assert (EAGLE_HEAD / "config.json").is_file()
    gpu = _up("--device", "cuda", monkeypatch=monkeypatch)
    assert (gpu.shape, gpu.spec_draft_length) == ("chain", 4)
    chain = _up("--shape", "chain", monkeypatch=monkeypatch)  # a shape of one's own keeps its flags
    assert (chain.draft, chain.shape, chain.tree_top_k, chain.spec_draft_length) == ("eagle", "chain", 4, 1)


def test_up_service_args_carry_the_chosen_draft(monkeypatch):
    from tandem.launcher import service_args

    _, router, draft = service_args(_up(monkeypatch=monkeypatch), Path("/models/default"))
    assert router[router.index("--spec-draft-length") + 1] == "1"
    assert draft[draft.index("--shape") + 1] == "tree" and draft[draft.index("--tree-node-budget") + 1] == "3"


def test_up_decodes_plainly_for_a_model_of_ones_own_unless_told(monkeypatch):
    assert _up("--model", "/models/mine", monkeypatch=monkeypatch).draft == "none"
    mine = _up("--model", "/models/mine", "--draft", "eagle", "--draft-model", "/heads/mine",
               "--spec-draft-length", "3", monkeypatch=monkeypatch)
    assert (mine.draft, mine.draft_model, mine.spec_draft_length) == ("eagle", "/heads/mine", 3)
    assert _up("--draft", "none", monkeypatch=monkeypatch).draft == "none"
