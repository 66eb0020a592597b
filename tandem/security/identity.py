"""Authorization by certificate identity between the services (mutual TLS).

A peer's identities are its certificate's DNS subject alternative names and its common name
(what gRPC's auth context reports for a verified client certificate). Each internal method
names the identities that may call it: the target serves steps and resets only to the router
and the peer stream only to the draft; the draft serves drafts and resets only to the router.
Health and reflection are not listed: they stay open (Kubernetes' gRPC probes present no
certificate)."""

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc

from tandem.errors import InvalidArgument
from tandem.security.guard import Refusal, service_of

DEFAULT_ROUTER_IDENTITY = "router"
DEFAULT_DRAFT_IDENTITY = "draft"
_IDENTITY_KEYS = ("x509_subject_alternative_name", "x509_common_name")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


# Names a certificate carries to be dialled by, on many certificates at once: never an identity.
_NOT_IDENTITIES = frozenset({"localhost"})


@dataclass(frozen=True, slots=True)
class Identities:
    """The names the services know each other by (certificate DNS SANs or CNs)."""

    router: str = DEFAULT_ROUTER_IDENTITY
    draft: str = DEFAULT_DRAFT_IDENTITY

    def __post_init__(self) -> None:
        for role, name in (("router", self.router), ("draft", self.draft)):
            if not name or name in _NOT_IDENTITIES or _is_ip(name):
                raise InvalidArgument(f"--{role}-identity {name!r}: a certificate name that only that service's"
                                      " certificate carries, not an address or localhost")


def peer_identities(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str]:
    """The verified names of the caller (DNS SANs and CN; IP SANs and localhost say where, not
    who); empty without a client certificate."""
    names: set[str] = set()
    for key in _IDENTITY_KEYS:
        for value in auth_context.get(key, ()):
            name = value.decode("utf-8", "replace")
            if not _is_ip(name) and name not in _NOT_IDENTITIES:
                names.add(name)
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """rules: full method name ("/tandem.v1.TargetEngine/Step") -> identities allowed. Every
    method of a service in `services` must have a rule; a method of another service is open."""

    rules: Mapping[str, frozenset[str]]
    services: frozenset[str] = field(default_factory=frozenset)

    def __call__(self, method: str, context) -> Refusal | None:
        if service_of(method) not in self.services:
            return None
        allowed = self.rules.get(method, frozenset())
        names = peer_identities(context.auth_context())
        if names & allowed:
            return None
        who = ", ".join(sorted(names)) or "no client certificate"
        return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                       f"{method} is served to {', '.join(sorted(allowed)) or 'no identity'}, not to {who}")


def _policy(service: str, rules: dict[str, Iterable[str]]) -> AccessPolicy:
    full = {f"/{service}/{name}": frozenset(ids) for name, ids in rules.items()}
    return AccessPolicy(MappingProxyType(full), frozenset({service}))


def target_policy(ids: Identities) -> AccessPolicy:
    from tandem.v1 import engine_pb2

    policy = _policy("tandem.v1.TargetEngine", {
        "Info": (ids.router, ids.draft),  # both check the model before they start
        "Step": (ids.router,), "Steps": (ids.router,), "Stats": (ids.router,), "Reset": (ids.router,),
        "Peer": (ids.draft,),
    })
    _check_complete(policy, engine_pb2.DESCRIPTOR.services_by_name["TargetEngine"])
    return policy


def draft_policy(ids: Identities) -> AccessPolicy:
    from tandem.v1 import engine_pb2

    policy = _policy("tandem.v1.DraftEngine", {
        "Info": (ids.router,), "Draft": (ids.router,), "Drafts": (ids.router,), "Stats": (ids.router,),
        "Reset": (ids.router,),
    })
    _check_complete(policy, engine_pb2.DESCRIPTOR.services_by_name["DraftEngine"])
    return policy


def _check_complete(policy: AccessPolicy, service) -> None:
    """A method added to the proto without a rule would be refused to everyone: say so at start."""
    missing = [m.name for m in service.methods if f"/{service.full_name}/{m.name}" not in policy.rules]
    assert not missing, f"{service.full_name}: no access rule for {missing}"
