"""The train-draft tests' tiny target, shared data folder and quick-mode runs."""

import dataclasses

import pytest

from tandem.cli import build_parser
from tandem.testing.tiny import build_tiny_model
from tandem.train.cli_args import config_from_args
from tandem.train.run import run_train_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def quick_config(tiny, out, data_dir, *flags, **changes):
    args = build_parser().parse_args(["train-draft", "--quick", "--model", str(tiny), "--out", str(out),
                                      "--data-dir", str(data_dir), *flags])
    cfg, _ = config_from_args(args)
    return dataclasses.replace(cfg, show_progress=False, **changes)


def train_quick(cfg) -> dict:
    return run_train_draft(cfg, None, log=lambda m: None)
