import pytest

from tandem.testing.tiny import build_tiny_model
from tests import reliability
from tests.services.harness import start_services


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, max_position_embeddings=512)


@pytest.fixture(scope="module")
def services(tiny_model):
    s = start_services(tiny_model)
    yield s
    reliability.served_by(s.stub)
    s.stop()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """After every services test: no pages or sequences left in the target."""
    yield
    if "services" not in request.fixturenames:
        return
    services = request.getfixturevalue("services")
    stats = services.wait_idle()
    if stats.sequences_live or stats.kv_pages_free != stats.kv_pages_total:
        reliability.leaks()
    assert stats.sequences_live == 0, stats
    assert stats.kv_pages_free == stats.kv_pages_total, stats
