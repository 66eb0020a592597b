"""The pure parts of tandem.security: certificates, TLS files and their rotation, identities and
access rules, API keys."""

import os
import stat
from types import SimpleNamespace

import grpc
import pytest
from cryptography import x509

from tandem.errors import InvalidArgument
from tandem.security.api_keys import ApiKeys, bearer_key, key_id, parse_keys
from tandem.security.certs import IDENTITIES, create_dir
from tandem.security.identity import Identities, draft_policy, peer_identities, target_policy
from tandem.security.tls import TlsConfig, TlsFiles


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    create_dir(folder, hosts=["target.internal", "10.0.0.7"])
    return folder


def _context(metadata=(), auth=None):
    return SimpleNamespace(invocation_metadata=lambda: metadata, auth_context=lambda: auth or {})


def test_certs_name_their_identity_and_hosts_and_keep_keys_private(certs):
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    for identity in IDENTITIES:
        cert = x509.load_pem_x509_certificate((certs / f"{identity}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        if identity == "client":  # dialled by nobody: its own name only
            assert san.get_values_for_type(x509.DNSName) == ["client"] and not ips
        else:
            assert san.get_values_for_type(x509.DNSName) == [identity, "localhost", "target.internal"]
            assert ips == {"127.0.0.1", "::1", "10.0.0.7"}
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert stat.S_IMODE(os.stat(certs / f"{identity}-key.pem").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(certs / "ca-key.pem").st_mode) == 0o600


def test_a_host_named_like_an_identity_is_refused(tmp_path):
    """--host router would put the router's name on the draft's certificate (and it could reset
    the target)."""
    with pytest.raises(InvalidArgument, match="an identity's name"):
        create_dir(tmp_path, hosts=["gpu-a", "router"])
    assert not (tmp_path / "draft.pem").exists()


def test_an_operators_ca_without_its_key_is_never_replaced(tmp_path):
    (tmp_path / "ca.pem").write_text("their CA")
    with pytest.raises(InvalidArgument, match="without its key"):
        create_dir(tmp_path)
    assert (tmp_path / "ca.pem").read_text() == "their CA"


def test_split_gives_each_identity_its_own_folder_without_the_ca_key(tmp_path):
    create_dir(tmp_path, split=True)
    for identity in IDENTITIES:
        files = sorted(p.name for p in (tmp_path / identity).iterdir())
        assert files == sorted(["ca.pem", f"{identity}.pem", f"{identity}-key.pem"]), files
        assert (tmp_path / identity / "ca.pem").read_bytes() == (tmp_path / "ca.pem").read_bytes()
        TlsFiles(TlsConfig(tmp_path / identity / f"{identity}.pem", tmp_path / identity / f"{identity}-key.pem",
                           tmp_path / identity / "ca.pem"))  # a matching pair


@pytest.mark.parametrize("name", ["localhost", "127.0.0.1", ""])
def test_identities_that_would_match_everyone_are_refused(name):
    with pytest.raises(InvalidArgument, match="--router-identity"):
        Identities(router=name)


def test_re_issuing_keeps_the_ca_unless_asked(tmp_path):
    create_dir(tmp_path, identities=("router",))
    ca = (tmp_path / "ca.pem").read_bytes()
    leaf = (tmp_path / "router.pem").read_bytes()
    create_dir(tmp_path, identities=("router",))
    assert (tmp_path / "ca.pem").read_bytes() == ca and (tmp_path / "router.pem").read_bytes() != leaf
    create_dir(tmp_path, identities=("router",), reuse_ca=False)
    assert (tmp_path / "ca.pem").read_bytes() != ca


def test_tls_config_is_checked_at_start(certs, tmp_path):
    with pytest.raises(InvalidArgument, match="go together"):
        TlsConfig(cert=certs / "router.pem")
    with pytest.raises(InvalidArgument, match="no such file"):
        TlsConfig(ca=tmp_path / "missing.pem")
    with pytest.raises(InvalidArgument, match="not the private key"):
        TlsFiles(TlsConfig(certs / "router.pem", certs / "draft-key.pem"))
    assert TlsConfig(certs / "router.pem", certs / "router-key.pem", certs / "ca.pem").mutual
    assert not TlsConfig(ca=certs / "ca.pem").serves_tls


def test_tls_files_take_a_rotation_only_once_it_is_consistent(tmp_path):
    create_dir(tmp_path, identities=("target", "draft"))
    files = TlsFiles(TlsConfig(tmp_path / "target.pem", tmp_path / "target-key.pem", tmp_path / "ca.pem"))
    first = files.material
    assert files.refresh() is None  # nothing changed
    (tmp_path / "target.pem").write_bytes((tmp_path / "draft.pem").read_bytes())  # the certificate first...
    assert files.refresh() is None and files.material == first  # ...its key not yet: the old pair stays
    (tmp_path / "target-key.pem").write_bytes((tmp_path / "draft-key.pem").read_bytes())
    new = files.refresh()
    assert new is not None and new.cert == (tmp_path / "draft.pem").read_bytes() and files.material == new


def test_identities_are_dns_names_and_the_common_name_not_addresses():
    auth = {"x509_subject_alternative_name": [b"router", b"localhost", b"127.0.0.1", b"::1"],
            "x509_common_name": [b"router"], "transport_security_type": [b"ssl"]}
    assert peer_identities(auth) == {"router"}  # localhost is on every certificate: nobody's identity
    assert peer_identities({}) == frozenset()


@pytest.mark.parametrize("policy, method, caller, allowed", [
    (target_policy(Identities()), "/tandem.v1.TargetEngine/Steps", "router", True),
    (target_policy(Identities()), "/tandem.v1.TargetEngine/Steps", "draft", False),
    (target_policy(Identities()), "/tandem.v1.TargetEngine/Peer", "draft", True),
    (target_policy(Identities()), "/tandem.v1.TargetEngine/Peer", "router", False),
    (target_policy(Identities(router="gw")), "/tandem.v1.TargetEngine/Reset", "router", False),
    (target_policy(Identities(router="gw")), "/tandem.v1.TargetEngine/Reset", "gw", True),
    (draft_policy(Identities()), "/tandem.v1.DraftEngine/Drafts", "router", True),
    (draft_policy(Identities()), "/tandem.v1.DraftEngine/Drafts", "client", False),
    (draft_policy(Identities()), "/grpc.health.v1.Health/Check", "client", True),
    (draft_policy(Identities()), "/tandem.v1.DraftEngine/NotAMethod", "router", False),
])
def test_access_rules(policy, method, caller, allowed):
    refusal = policy(method, _context(auth={"x509_common_name": [caller.encode()]}))
    assert (refusal is None) == allowed
    if not allowed:
        assert refusal.code == grpc.StatusCode.PERMISSION_DENIED and caller in refusal.message


def test_every_internal_method_has_a_rule():
    from tandem.v1 import engine_pb2

    for service, policy in (("TargetEngine", target_policy(Identities())), ("DraftEngine", draft_policy(Identities()))):
        methods = engine_pb2.DESCRIPTOR.services_by_name[service].methods
        assert {f"/tandem.v1.{service}/{m.name}" for m in methods} == set(policy.rules)


def test_key_files_and_bearer_metadata():
    assert parse_keys("# ops team\nsk-a\n\n  sk-b  \n") == (b"sk-a", b"sk-b")
    assert bearer_key([("x-other", "1"), ("authorization", "Bearer sk-a")]) == "sk-a"
    assert bearer_key([("authorization", "bearer  sk-a ")]) == "sk-a"
    assert bearer_key([("authorization", "Basic sk-a")]) is None and bearer_key(None) is None
    assert len(key_id("sk-a")) == 12 and key_id("sk-a") != key_id("sk-b")


def test_api_keys_refuse_without_naming_the_key_and_follow_the_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one\n")
    keys = ApiKeys(path)
    method = "/tandem.v1.Generation/Generate"
    assert keys(method, _context([("authorization", "Bearer sk-one")])) is None
    refusal = keys(method, _context([("authorization", "Bearer sk-two")]))
    assert refusal.code == grpc.StatusCode.UNAUTHENTICATED and "sk-two" not in refusal.message
    assert keys(method, _context()).message.startswith("missing API key")
    assert keys("/grpc.health.v1.Health/Check", _context()) is None
    path.write_text("sk-two\n")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert keys(method, _context([("authorization", "Bearer sk-two")])) is None
    assert keys(method, _context([("authorization", "Bearer sk-one")])) is not None
    path.unlink()  # unreadable later: the keys in use stay
    assert keys(method, _context([("authorization", "Bearer sk-two")])) is None


def test_an_empty_key_file_is_refused_at_start(tmp_path):
    (tmp_path / "keys").write_text("# none yet\n")
    with pytest.raises(InvalidArgument, match="no keys"):
        ApiKeys(tmp_path / "keys")
