"""Mutual TLS between the services, TLS and API keys on the public port, authorization by
certificate identity, and certificates and keys rotated on disk without a restart: real servers
on loopback, certificates from `tandem certs create`."""

import shutil
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.channels import open_channel
from tandem.models.eagle_io import random_eagle_checkpoint
from tandem.security.certs import create_dir
from tandem.security.tls import PLAINTEXT, TlsConfig
from tandem.bench.services import free_port
from tandem.testing.tiny import TINY_PROMPTS
from tandem.v1 import engine_pb2 as epb
from tandem.v1 import engine_pb2_grpc
from tandem.v1 import generate_pb2 as pb
from tests.services.harness import identity_tls, start_services
from tests.services.eagle_fixtures import reference, tiny_model  # noqa: F401 (fixtures)
from tests.services.test_generate import greedy

KEY = "sk-tandem-test-key-1"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    create_dir(folder)
    return folder


@pytest.fixture(scope="module")
def services(tiny_model, certs, tmp_path_factory):
    """EAGLE over mutual TLS (the peer stream too), the public port over TLS with API keys."""
    head = random_eagle_checkpoint(tmp_path_factory.mktemp("head") / "head", tiny_model, seed=3, num_layers=1)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\n{KEY}\n")
    health_port = free_port()
    s = start_services(tiny_model, draft_model=head, certs=certs, router={"spec_draft_length": 3, "api_key_file": keys},
                       target={"health_port": health_port})
    s.keys_file, s.target_health_port = keys, health_port
    yield s
    s.stop()


@pytest.fixture
def secured(services):  # named `services`, the suite's no_leaks check runs after each test
    return services


def _auth(key: str = KEY):
    return (("authorization", f"Bearer {key}"),)


def _call(stub_call, request, **kw):
    try:
        return stub_call(request, timeout=10, **kw), None
    except grpc.RpcError as e:
        return None, e


def test_greedy_over_mutual_tls_equals_the_target_and_speculates(secured, reference):
    for prompt in TINY_PROMPTS:
        responses = list(secured.stub.Generate(pb.GenerateRequest(prompt=prompt, params=greedy()), timeout=60,
                                               metadata=_auth()))
        ids = [t for r in responses for c in r.choices for t in c.token_ids]
        assert ids == reference[prompt], prompt
    assert secured.stub.Stats(pb.StatsRequest(), metadata=_auth()).draft_tokens_total > 0  # the peer stream ran


@pytest.mark.parametrize("metadata, needle", [
    ((), "missing API key"),
    (_auth("sk-wrong"), "invalid API key"),
    ((("authorization", f"Basic {KEY}"),), "missing API key"),
    ((("authorization", "Bearer "),), "invalid API key"),
])
def test_the_public_api_wants_a_key(secured, metadata, needle):
    stub = secured.stub
    for call, request in ((stub.Generate, pb.GenerateRequest(prompt="hi")), (stub.Tokenize, pb.TokenizeRequest(prompt="hi")),
                          (stub.ModelInfo, pb.ModelInfoRequest()), (stub.Stats, pb.StatsRequest())):
        with pytest.raises(grpc.RpcError) as info:
            result = call(request, timeout=10, metadata=metadata)
            list(result) if call is stub.Generate else result
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        assert needle in info.value.details() and KEY not in info.value.details()
    health = health_pb2_grpc.HealthStub(secured.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no key


def test_keys_are_re_read_when_the_file_changes(secured):
    new = "sk-added-later"
    tokenize = secured.stub.Tokenize
    assert _call(tokenize, pb.TokenizeRequest(prompt="hi"), metadata=_auth(new))[1].code() == grpc.StatusCode.UNAUTHENTICATED
    original = secured.keys_file.read_text()
    try:
        secured.keys_file.write_text(f"{new}\n")  # the old key revoked, a new one added
        _bump_mtime(secured.keys_file)
        assert _call(tokenize, pb.TokenizeRequest(prompt="hi"), metadata=_auth(new))[0].token_ids
        assert _call(tokenize, pb.TokenizeRequest(prompt="hi"), metadata=_auth())[1].code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        secured.keys_file.write_text(original)
        _bump_mtime(secured.keys_file)
    assert _call(tokenize, pb.TokenizeRequest(prompt="hi"), metadata=_auth())[0].token_ids


def _bump_mtime(path) -> None:
    """A write within the file system's timestamp granularity may keep the mtime: move it on."""
    st = path.stat()
    import os

    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


@pytest.mark.parametrize("who, method, allowed", [
    ("router", "Reset", True), ("draft", "Reset", False), ("client", "Reset", False),
    ("client", "Step", False), ("draft", "Stats", False), ("client", "Info", False), ("draft", "Info", True),
])
def test_the_target_serves_each_method_to_its_identity_only(secured, certs, who, method, allowed):
    requests = {"Reset": epb.ResetRequest(), "Step": epb.StepRequest(), "Stats": epb.EngineStatsRequest(),
                "Info": epb.InfoRequest()}
    if method == "Reset":
        secured.wait_idle()  # nothing running for a reset to cut
    with open_channel(f"127.0.0.1:{secured.target_port}", identity_tls(certs, who)) as ch:
        _, error = _call(getattr(engine_pb2_grpc.TargetEngineStub(ch), method), requests[method])
    if allowed:
        assert error is None
    else:
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert who in error.details() and f"TargetEngine/{method}" in error.details()


def test_the_peer_stream_and_drafts_refuse_other_identities(secured, certs):
    with open_channel(f"127.0.0.1:{secured.target_port}", identity_tls(certs, "router")) as ch:
        stream = engine_pb2_grpc.TargetEngineStub(ch).Peer(iter([epb.DraftToTarget()]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(stream)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "served to draft" in info.value.details() and "router" in info.value.details()
    for who in ("client", "target"):
        with open_channel(f"127.0.0.1:{secured.draft_port}", identity_tls(certs, who)) as ch:
            stub = engine_pb2_grpc.DraftEngineStub(ch)
            for call, request in ((stub.Draft, epb.DraftRequest()), (stub.Reset, epb.ResetRequest())):
                assert _call(call, request)[1].code() == grpc.StatusCode.PERMISSION_DENIED
    # and the services it refused go on: a request streams as before
    assert len(generate_keyed(secured)) == 4


def generate_keyed(secured) -> list[int]:
    responses = secured.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[0], params=greedy(4)), timeout=60,
                                      metadata=_auth())
    return [t for r in responses for c in r.choices for t in c.token_ids]


def test_plaintext_and_foreign_certificates_get_no_connection(secured, tmp_path):
    address = f"127.0.0.1:{secured.target_port}"
    stranger = tmp_path / "stranger"
    create_dir(stranger)  # another CA: its "router" is nobody here
    for tls in (PLAINTEXT, TlsConfig(ca=secured.router_tls.ca), identity_tls(stranger, "router")):
        with open_channel(address, tls) as ch:
            _, error = _call(engine_pb2_grpc.TargetEngineStub(ch).Reset, epb.ResetRequest())
        assert error.code() == grpc.StatusCode.UNAVAILABLE, tls


def test_the_probe_port_answers_health_checks_only(secured):
    """Plaintext, for probes without certificates: Check answers (the service's own status);
    the service's methods and Watch streams (which could hold its threads) are not there."""
    with grpc.insecure_channel(f"127.0.0.1:{secured.target_health_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        named = health_pb2.HealthCheckRequest(service="tandem.v1.TargetEngine")
        assert health.Check(named, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        _, error = _call(engine_pb2_grpc.TargetEngineStub(ch).Reset, epb.ResetRequest())
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(watch)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rotated_certificates_are_served_to_new_connections(secured, certs, tmp_path):
    """The target's certificate re-issued with another name in it: a client that dials that name
    connects once the files changed, without a restart (before, the handshake fails)."""
    name = "rotated.tandem.test"
    options = [("grpc.ssl_target_name_override", name)]
    address = f"127.0.0.1:{secured.target_port}"

    def info_by_name():
        with open_channel(address, identity_tls(certs, "router"), options=options) as ch:
            return _call(engine_pb2_grpc.TargetEngineStub(ch).Info, epb.InfoRequest())[1]

    assert info_by_name().code() == grpc.StatusCode.UNAVAILABLE
    saved = {n: (certs / n).read_bytes() for n in ("target.pem", "target-key.pem")}
    try:
        staging = tmp_path / "staging"
        shutil.copytree(certs, staging)
        create_dir(staging, hosts=[name], identities=("target",))  # the same CA, a new leaf
        for n in saved:
            shutil.copyfile(staging / n, certs / n)
        deadline = time.monotonic() + 10
        while (error := info_by_name()) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert error is None, error.details()
    finally:
        for n, data in saved.items():
            (certs / n).write_bytes(data)


def test_the_router_takes_a_new_ca_and_certificate_when_it_reconnects(tiny_model, tmp_path):
    """Every certificate re-issued from a new CA while the services run; the target then
    restarts (its old connections go). The router's next connection must present its new
    certificate and trust the new CA: it makes a new channel when it resets the target."""
    from dataclasses import replace

    from target_service.config import TargetConfig
    from target_service.engine import TargetEngine
    from target_service.server import start_target

    certs = tmp_path / "certs"
    create_dir(certs)
    s = start_services(tiny_model, certs=certs, router={"step_timeout_s": 5.0})
    try:
        params = greedy(4)
        before = [t for r in s.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[0], params=params), timeout=60)
                  for c in r.choices for t in c.token_ids]
        staging = tmp_path / "new"
        create_dir(staging)  # a new CA, new leaves
        for path in staging.iterdir():  # the pairs before the CA: each file whole (renamed in place)
            shutil.copyfile(path, certs / f"{path.name}.new")
            (certs / f"{path.name}.new").replace(certs / path.name)
        config = replace(TargetConfig(model_dir=tiny_model, port=s.target_port, kv_cache_tokens=8192, kv_page_size=8),
                         tls=identity_tls(certs, "target"))
        engine = TargetEngine(config)
        s.target_server.stop(0).wait()
        s.target_server, _, _, s.target_engine, _ = start_target(config, engine)
        s.channel.close()  # the harness's own client trusts the new CA from now on
        s.channel = open_channel(f"127.0.0.1:{s.router_port}", TlsConfig(ca=certs / "ca.pem"))
        deadline = time.monotonic() + 60
        while True:
            try:
                after = [t for r in s.stub.Generate(pb.GenerateRequest(prompt=TINY_PROMPTS[0], params=params),
                                                    timeout=30) for c in r.choices for t in c.token_ids]
                break
            except grpc.RpcError as e:  # UNAVAILABLE while the router finds the target again
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e.details()
                time.sleep(0.5)
        assert after == before
    finally:
        s.stop()
