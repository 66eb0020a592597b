"""The HTTP API behind the gRPC port's public TLS certificate and API keys: HTTPS verified
against the CA, plaintext refused, keys required, and certificates rotated on disk served to
the next connection without a restart (certificates from `tandem certs create`)."""

import shutil
import ssl

import httpx2
import openai
import pytest

from tandem.bench.services import free_port
from tandem.security.certs import create_dir
from tandem.security.tls import TlsConfig
from tests.services.harness import start_services
from tests.services.test_openai_api import CHAT
from tests.services.test_tls import certs  # noqa: F401 (fixture)

KEY = "sk-tandem-https-test"


@pytest.fixture(scope="module")
def services(tiny_model, certs, tmp_path_factory):
    """Mutual TLS between the services; the public ports serve a copy of the router's pair (the
    rotation test replaces it without touching the router's own identity)."""
    public = tmp_path_factory.mktemp("public")
    for name in ("router.pem", "router-key.pem"):
        shutil.copy(certs / name, public / name)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\n")
    port = free_port()
    s = start_services(tiny_model, certs=certs, router={
        "http_port": port, "api_key_file": keys,
        "public_tls": TlsConfig(public / "router.pem", public / "router-key.pem")})
    s.base_url, s.public = f"https://127.0.0.1:{port}/v1", public
    yield s
    s.stop()


def _client(services, ca, key: str = KEY) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=str(ca))
    return openai.OpenAI(base_url=services.base_url, api_key=key, max_retries=0, timeout=30,
                         http_client=httpx2.Client(verify=verify))


def test_https_with_the_public_certificate_and_a_key(services, certs):
    with _client(services, certs / "ca.pem") as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
    with _client(services, certs / "ca.pem", key="sk-nope") as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_plaintext_gets_no_answer(services):
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(services.base_url.replace("https://", "http://") + "/models", timeout=5)


def test_a_rotated_certificate_is_served_to_the_next_connection(services, certs, tmp_path):
    other = tmp_path / "other"
    create_dir(other)
    for name in ("router.pem", "router-key.pem"):
        shutil.copy(other / name, services.public / name)
    with _client(services, other / "ca.pem") as client:
        assert client.models.list().data  # the new CA's certificate, no restart
    with _client(services, certs / "ca.pem") as client:
        with pytest.raises(openai.APIConnectionError):  # the old CA no longer verifies it
            client.models.list()
