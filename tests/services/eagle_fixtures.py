"""Fixtures of the EAGLE services tests: a 1-layer tiny target, transformers' greedy outputs on
it, and a head trained on it in about 10 s. Import them into a test module (module scope).

A 1-layer target: a 2-layer random one is too chaotic for a head trained in seconds to predict
(about 2% top-1), while this one gives a trained head about 50%."""

import pytest

from tandem.testing.eagle_train import train_tiny_eagle
from tandem.testing.tiny import build_tiny_model
from tests.services.test_generate import transformers_greedy


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny1", seed=0, num_layers=1)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return transformers_greedy(tiny_model)


@pytest.fixture(scope="module")
def trained_head(tiny_model, tmp_path_factory):
    return train_tiny_eagle(tiny_model, tmp_path_factory.mktemp("heads") / "trained", seed=0)
