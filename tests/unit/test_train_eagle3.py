"""`tandem train-draft --eagle3` in quick mode on a tiny target: the loss falls, the head written
in the public EAGLE-3 format computes in serving what it computed in training, --eval-head and
--init-head take EAGLE-3 folders (public configs without the aux layers too), and flags that
belong to other heads, or a resume that switches generation, are refused."""

import json
import shutil

import pytest
import torch

from tandem.attention.torch_backend import TorchAttention
from tandem.errors import InvalidArgument
from tandem.models.eagle3 import load_eagle3_head
from tandem.models.eagle_io import D2T_FILE, random_eagle_checkpoint
from tandem.train.dataset import ShardedData
from tandem.train.loop import load_checkpoint
from tandem.train.methods import DRAFT_METHODS
from tests.unit.test_train_draft import assert_the_head_folder_evaluates_as_its_run, full_data_loss, run_loaded_head
from tests.unit.train_helpers import data_dir, quick_config, tiny, train_quick  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def eagle3_run(tiny, data_dir, tmp_path_factory):
    cfg = quick_config(tiny, tmp_path_factory.mktemp("eagle3"), data_dir, "--eagle3", "--ttt-steps", "2",
                       "--draft-vocab", "100")
    train_quick(cfg)
    return cfg


def test_trained_eagle3_head_computes_what_the_serving_head_computes(eagle3_run, tiny):
    """--eagle3 with a pruned vocabulary and 2 unrolled steps lowers the loss and writes the public
    EAGLE-3 format: the served head's prefill on the run's aux inputs equals step 0 of the unroll,
    a decode of its own output equals step 1, its scores are the trainer's, and --eval-head on the
    folder (no --eagle3: the folder says it) gives the run's figures."""
    cfg = eagle3_run
    assert cfg.aux_layers == (0, 1)  # 2, L/2, L-3 clamped into the tiny target's 2 layers
    saved = load_checkpoint(cfg.run_dir)["model"]
    assert full_data_loss(cfg, saved) < 0.9 * full_data_loss(cfg, None)
    config = json.loads((cfg.run_dir / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 100
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1] and not (cfg.run_dir / "head" / D2T_FILE).exists()
    data = ShardedData(cfg.data_dir, [1], aux_layers=cfg.aux_layers)
    module = DRAFT_METHODS["eagle"](cfg).build(data, saved)
    module.load_state_dict(saved)
    batch, anchor = data.batch([0]), 6
    with torch.no_grad():
        step0, step1 = module.unroll(batch.tokens, batch.aux, 2)
        trained_scores = module.readout(step0[0, : anchor + 1]) @ module.lm_head.T
    head = load_eagle3_head(cfg.run_dir / "head", tiny, dtype=torch.float32, backend=TorchAttention())
    assert torch.equal(head.vocab_ids, module.d2t)
    tokens, aux = batch.tokens[0], batch.aux[0]
    prefill, decode = run_loaded_head(head, tokens[1 : anchor + 2], aux[: anchor + 1])
    assert torch.allclose(prefill, step0[0, : anchor + 1], atol=1e-4)
    assert torch.allclose(head.scores(prefill), trained_scores, atol=1e-3)
    chained = decode(tokens[anchor + 2 : anchor + 3], prefill[-1:])
    assert torch.allclose(chained[0], step1[0, anchor], atol=1e-4)
    assert_the_head_folder_evaluates_as_its_run(cfg)


def test_a_public_config_without_aux_layers_reads_the_default_ones(eagle3_run, tiny, tmp_path):
    """Published EAGLE-3 configs often leave out eagle_aux_hidden_state_layer_ids: the head then
    reads EAGLE-3's default layers, in serving and in --eval-head / --init-head."""
    head = tmp_path / "public"
    shutil.copytree(eagle3_run.run_dir / "head", head)
    config = json.loads((head / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (head / "config.json").write_text(json.dumps(config))
    assert load_eagle3_head(head, tiny, dtype=torch.float32, backend=TorchAttention()).feature_layers == (0, 1)
    for flag in ("--eval-head", "--init-head"):
        cfg = quick_config(tiny, tmp_path / flag, eagle3_run.data_dir, flag, str(head))
        assert cfg.aux_layers == (0, 1)
    cfg = quick_config(tiny, tmp_path / "more", eagle3_run.data_dir, "--init-head", str(head), "--steps", "2")
    assert train_quick(cfg)["status"] == "done"


@pytest.mark.parametrize("flags", [["--draft-layers", "2"], ["--init-from-target"], ["--soft-labels"],
                                   ["--method", "medusa"]])
def test_eagle3_refuses_flags_of_other_heads(tiny, tmp_path, flags):
    with pytest.raises(SystemExit, match="has one layer and trains on the token loss; it cannot go with"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--eagle3", *flags)


def test_eagle3_refuses_an_eagle1_init_head(tiny, tmp_path):
    head = random_eagle_checkpoint(tmp_path / "head", tiny)
    with pytest.raises(SystemExit, match="an EAGLE-1/2 head"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--eagle3", "--init-head", str(head))



@pytest.mark.parametrize("flags", [["--soft-labels"], ["--draft-layers", "2"]])
def test_an_eagle3_init_head_refuses_flags_of_other_heads(eagle3_run, tiny, tmp_path, flags):
    with pytest.raises(SystemExit, match="an EAGLE-3 --init-head"):
        quick_config(tiny, tmp_path / "run", tmp_path / "data", "--init-head", str(eagle3_run.run_dir / "head"), *flags)


def test_a_resume_keeps_the_heads_generation(tiny, data_dir, tmp_path):
    cfg = quick_config(tiny, tmp_path / "run", data_dir, "--steps", "2")
    train_quick(cfg)
    with pytest.raises(InvalidArgument, match="trains an EAGLE-1/2 head; resume it without --eagle3"):
        train_quick(quick_config(tiny, tmp_path / "run", data_dir, "--eagle3", "--steps", "4", "--resume"))
