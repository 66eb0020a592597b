"""The `tandem` parser: building it (every subcommand's flags) imports no torch or
transformers, so `tandem health`, which compose's healthchecks run every few seconds, is fast."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import build_parser, draft_config
from tandem.errors import InvalidArgument

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
                 "TREE_NODE_BUDGET", "PROPOSAL_TOP_K"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)
    return resolve_up_draft(build_parser().parse_args(["up", *flags]))


def test_up_auto_drafts_with_the_shipped_eagle_head_in_the_devices_shape(monkeypatch):
    from tandem.models.heads import EAGLE_HEAD

    gpu = _up("--device", "cuda", monkeypatch=monkeypatch)
    assert (gpu.draft, gpu.draft_model, gpu.shape, gpu.spec_draft_length) == ("eagle", EAGLE_HEAD, "tree", 4)
    assert (gpu.tree_top_k, gpu.tree_node_budget) == (8, 30)
    assert (EAGLE_HEAD / "config.json").is_file()
    cpu = _up(monkeypatch=monkeypatch)
    assert (cpu.draft, cpu.draft_model, cpu.shape, cpu.spec_draft_length) == ("eagle", EAGLE_HEAD, "tree", 2)
    assert (cpu.tree_top_k, cpu.tree_node_budget, cpu.spec_disable_batch_size) == (2, 4, 2)


def test_up_named_method_takes_the_shipped_head_in_the_devices_shape(monkeypatch):
    from tandem.models.heads import EAGLE_HEAD, MEDUSA_HEAD

    eagle = _up("--draft", "eagle", monkeypatch=monkeypatch)
    assert (eagle.draft_model, eagle.shape, eagle.spec_draft_length) == (EAGLE_HEAD, "tree", 2)
    assert (eagle.tree_top_k, eagle.tree_node_budget) == (2, 4)  # on a CPU: depth 2, the draft's 2 best tokens
    chain = _up("--draft", "eagle", "--shape", "chain", monkeypatch=monkeypatch)  # a shape of one's own is kept
    assert (chain.shape, chain.spec_draft_length) == ("chain", 2)
    medusa = _up("--draft", "medusa", monkeypatch=monkeypatch)
    assert (medusa.draft_model, medusa.shape) == (MEDUSA_HEAD, None)  # Medusa's own default shape
    assert (medusa.tree_node_budget, medusa.spec_draft_length) == (4, 2)  # the first 4 nodes of its tree
    on_gpu = _up("--draft", "medusa", "--device", "cuda:1", monkeypatch=monkeypatch)
    assert (on_gpu.tree_node_budget, on_gpu.spec_draft_length) == (30, 4)  # the first 30 nodes of its tree
    mine = _up("--draft", "eagle", "--device", "cuda", "--tree-node-budget", "12", monkeypatch=monkeypatch)
    assert (mine.shape, mine.tree_top_k, mine.tree_node_budget) == ("tree", 8, 12)  # a flag given is kept


def test_up_decodes_plainly_for_a_model_of_ones_own_unless_told(monkeypatch):
    assert _up("--model", "/models/mine", "--device", "cuda", monkeypatch=monkeypatch).draft == "none"
    mine = _up("--model", "/models/mine", "--draft", "eagle", "--draft-model", "/heads/mine",
               "--spec-draft-length", "3", monkeypatch=monkeypatch)
    assert (mine.draft, mine.draft_model, mine.spec_draft_length) == ("eagle", "/heads/mine", 3)
    assert _up("--model", "/models/mine", "--draft", "eagle", monkeypatch=monkeypatch).draft_model is None
    assert _up("--draft", "none", "--device", "cuda", monkeypatch=monkeypatch).draft == "none"


def test_up_service_args_carry_the_chosen_draft(monkeypatch):
    from tandem.launcher import service_args
    from tandem.models.heads import CPU_SHAPE

    _, router, draft = service_args(_up("--draft", "eagle", monkeypatch=monkeypatch), Path("/models/default"))
    assert router[router.index("--spec-draft-length") + 1] == "2"
    assert router[router.index("--spec-disable-batch-size") + 1] == str(CPU_SHAPE.spec_disable_batch_size)
    _, mine, _ = service_args(_up("--draft", "eagle", "--spec-disable-batch-size", "6", monkeypatch=monkeypatch), Path("/m"))
    assert mine[mine.index("--spec-disable-batch-size") + 1] == "6"
    assert draft[draft.index("--shape") + 1] == "tree"
    assert draft[draft.index("--tree-node-budget") + 1] == "4"
    assert draft[draft.index("--draft-model") + 1].endswith("heads/eagle-smollm2-135m")
    assert draft[draft.index("--proposal-top-k") + 1] == "0"
    _, _, cut = service_args(_up("--draft", "eagle", "--proposal-top-k", "64", monkeypatch=monkeypatch), Path("/m"))
    assert cut[cut.index("--proposal-top-k") + 1] == "64"
    config = draft_config(build_parser().parse_args(["draft", *cut[1:]]), Path("/m"))
    assert config.proposal_top_k == 64


def test_up_gives_the_draft_the_targets_cache_and_sequence_limits(monkeypatch):
    """The draft holds a KV cache and a slot per sequence too: `tandem up`'s limits reach it, or
    the smaller default would cap sequences (64) and silently stop speculating on a full cache."""
    from tandem.launcher import service_args

    flags = ("--kv-cache-tokens", "131072", "--max-num-sequence", "256", "--kv-page-size", "32")
    target, _, draft = service_args(_up("--draft", "eagle", *flags, monkeypatch=monkeypatch), Path("/m"))
    config = draft_config(build_parser().parse_args(["draft", *draft[1:]]), Path("/m"))
    assert (config.kv_cache_tokens, config.max_num_sequence, config.kv_page_size) == (131072, 256, 32)
    for flag in ("--kv-cache-tokens", "--max-num-sequence", "--kv-page-size"):
        assert target[target.index(flag) + 1] == draft[draft.index(flag) + 1]


def test_enforce_eager_has_its_environment_fallback(monkeypatch):
    """compose sets every flag through TANDEM_*; CUDA graphs must be switchable off there too."""
    for service in ("target", "draft"):
        argv = [service, "--draft-model", "/h"] if service == "draft" else [service]
        assert not build_parser().parse_args(argv).enforce_eager
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "1")
    assert build_parser().parse_args(["target"]).enforce_eager
    assert build_parser().parse_args(["draft", "--draft-model", "/h"]).enforce_eager


@pytest.mark.parametrize("raw, expected", [("on", True), ("Yes", True), ("off", False), ("0", False), ("", False)])
def test_boolean_environment_variables_read_one_way(monkeypatch, raw, expected):
    """Service (TANDEM_*) and training (TANDEM_TRAIN_*) flags take the same spellings."""
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", raw)
    monkeypatch.setenv("TANDEM_TRAIN_RESUME", raw)
    assert build_parser().parse_args(["target"]).enforce_eager is expected
    assert build_parser().parse_args(["train-draft", "--method", "eagle"]).resume is expected


def test_a_boolean_environment_variable_of_another_spelling_stops_the_command_that_reads_it(monkeypatch):
    from tandem.envvars import check_flags

    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "enabled")
    with pytest.raises(SystemExit, match="TANDEM_ENFORCE_EAGER='enabled': expected"):
        check_flags(build_parser().parse_args(["target"]))
    check_flags(build_parser().parse_args(["health", "127.0.0.1:50051"]))  # it reads no such flag


def test_the_drafts_lm_head_is_int8_on_cpu_unless_told(monkeypatch):
    from tandem.launcher import service_args

    def drafted(*flags):
        _, _, draft = service_args(_up("--draft", "eagle", *flags, monkeypatch=monkeypatch), Path("/m"))
        return draft_config(build_parser().parse_args(["draft", *draft[1:]]), Path("/m")).lm_head_quant

    assert drafted() == "int8"
    assert drafted("--draft-lm-head-quant", "none") == "none"
    on_gpu = build_parser().parse_args(["draft", "--draft-model", "/h", "--device", "cuda:0"])
    assert draft_config(on_gpu, Path("/m")).lm_head_quant == "none"
    asked = build_parser().parse_args(["draft", "--draft-model", "/h", "--device", "cuda:0", "--draft-lm-head-quant", "int8"])
    with pytest.raises(InvalidArgument, match="CPU only"):
        draft_config(asked, Path("/m"))


def test_an_eagle_heads_own_projections_are_int8_on_cpu_unless_told(monkeypatch):
    from tandem.launcher import service_args

    def drafted(method, *flags):
        _, _, draft = service_args(_up("--draft", method, *flags, monkeypatch=monkeypatch), Path("/m"))
        return draft_config(build_parser().parse_args(["draft", *draft[1:]]), Path("/m")).head_quant

    assert drafted("eagle") == "int8" and drafted("medusa") == "none"
    assert drafted("eagle", "--draft-head-quant", "none") == "none"
    on_gpu = build_parser().parse_args(["draft", "--draft-model", "/h", "--device", "cuda:0"])
    assert draft_config(on_gpu, Path("/m")).head_quant == "none"
    for asked in (["--device", "cuda:0"], ["--method", "medusa"]):
        args = build_parser().parse_args(["draft", "--draft-model", "/h", *asked, "--draft-head-quant", "int8"])
        with pytest.raises(InvalidArgument, match="EAGLE head's, on CPU only"):
            draft_config(args, Path("/m"))


@pytest.mark.parametrize("given, expected", [(None, "3000"), ("77", "77")])
def test_services_bound_openmp_spinning_unless_the_environment_says(given, expected):
    """Each service process (python -m tandem.cli ...) shortens libgomp's busy-wait before torch
    loads it (tandem.cli); a value the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    probe = "import os, sys, tandem.cli; assert 'torch' not in sys.modules; print(os.environ['GOMP_SPINCOUNT'])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_up_passes_every_router_flag_through(monkeypatch, tmp_path):
    """Each flag `tandem up` shares with `tandem router` reaches the router's command line with
    the value given, and the router's config takes it."""
    from tandem.cli import router_config, router_flag_options
    from tandem.launcher import service_args

    keys = tmp_path / "keys"
    keys.write_text("sk-1\n")
    given = {"--max-waiting": "7", "--max-running-requests": "3", "--max-concurrent-rpcs": "40",
             "--shutdown-grace-s": "5.0", "--api-key-file": str(keys), "--max-prompt-bytes": "1000",
             "--max-n": "4", "--min-ping-interval-s": "2.0", "--served-model-name": "smollm2", "--http-port": "8123"}
    _, router, _ = service_args(_up("--draft", "none", *[x for kv in given.items() for x in kv], monkeypatch=monkeypatch),
                                Path("/m"))
    for option, _ in router_flag_options():
        assert option in router, option
    for option, value in given.items():
        assert router[router.index(option) + 1] == value, option
    config = router_config(build_parser().parse_args(router), Path("/m"))
    assert (config.max_waiting, config.max_running_requests, config.max_concurrent_rpcs) == (7, 3, 40)
    assert config.api_key_file == keys and config.shutdown_grace_s == 5.0
    assert (config.request_limits.max_prompt_bytes, config.request_limits.max_n) == (1000, 4)
    assert (config.served_model_name, config.http_port) == ("smollm2", 8123)


def test_up_tls_dir_gives_each_service_its_identity(monkeypatch, tmp_path):
    from tandem.cli import draft_config, router_config, target_config
    from tandem.launcher import service_args
    from tandem.security.certs import create_dir

    create_dir(tmp_path)
    target, router, draft = service_args(_up("--draft", "eagle", "--tls-dir", str(tmp_path), monkeypatch=monkeypatch),
                                         Path("/m"))
    parser = build_parser()
    for name, argv, make in (("target", target, target_config), ("router", router, router_config)):
        config = make(parser.parse_args(argv), Path("/m"))
        assert config.tls.cert == tmp_path / f"{name}.pem" and config.tls.key == tmp_path / f"{name}-key.pem"
        assert config.tls.ca == tmp_path / "ca.pem" and config.tls.mutual
    public = router_config(parser.parse_args(router), Path("/m")).public_tls
    assert public.cert == tmp_path / "router.pem" and public.ca is None  # TLS, no client certificates
    assert draft[draft.index("--tls-cert") + 1] == str(tmp_path / "draft.pem")


def test_certs_create_writes_a_ca_and_four_identities(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "certs", "create", str(tmp_path / "c")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == sorted(["ca.pem", "ca-key.pem", *(f"{n}{s}" for n in ("router", "target", "draft", "client")
                                                      for s in (".pem", "-key.pem"))])
