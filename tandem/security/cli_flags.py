"""The command line's security flags (docs/deploy.md): a service's identity and trust bundle,
the certificate names it authorizes by, the public port's TLS and API keys, a client's TLS, and
`tandem certs create`. Each flag falls back to its TANDEM_* variable."""

import argparse
from pathlib import Path

from tandem.envvars import env_default as _env


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """A service's identity and trust bundle (docs/deploy.md), and its plaintext probe port."""
    p.add_argument("--tls-cert", default=_env("tls_cert", None),
                   help="PEM certificate of this service's identity: with --tls-key it serves TLS")
    p.add_argument("--tls-key", default=_env("tls_key", None), help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=_env("tls_ca", None),
                   help="PEM trust bundle: with it the internal port requires client certificates it signed (mutual"
                        " TLS) and outgoing channels verify servers against it and present --tls-cert")
    p.add_argument("--health-port", type=int, default=_env("health_port", 0),
                   help="a plaintext port of its own answering grpc.health.v1 Check only, for probes that present"
                        " no certificate (0: none)")


def add_identity_flags(p: argparse.ArgumentParser) -> None:
    from tandem.security.identity import DEFAULT_DRAFT_IDENTITY, DEFAULT_ROUTER_IDENTITY

    p.add_argument("--router-identity", default=_env("router_identity", DEFAULT_ROUTER_IDENTITY),
                   help="mutual TLS: the certificate name (DNS SAN or CN) of the router, the only caller of steps,"
                        " drafts and resets")
    p.add_argument("--draft-identity", default=_env("draft_identity", DEFAULT_DRAFT_IDENTITY),
                   help="mutual TLS: the certificate name of the draft, the only caller of the target's peer stream")


def add_public_security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--public-tls-cert", default=_env("public_tls_cert", None),
                   help="PEM certificate of the public port: with --public-tls-key it serves TLS (the router's"
                        " own --tls-* are for its channels to the target and the draft)")
    p.add_argument("--public-tls-key", default=_env("public_tls_key", None), help="the key of --public-tls-cert")
    p.add_argument("--public-tls-client-ca", default=_env("public_tls_client_ca", None),
                   help="require public clients' certificates signed by this PEM bundle")


def tls_config(args):
    from tandem.security.tls import TlsConfig

    return TlsConfig(*(Path(p) if p else None for p in (args.tls_cert, args.tls_key, args.tls_ca)))


def public_tls_config(args):
    """The public port's TLS: its own files only (TLS may end at a load balancer in front of a
    router whose internal channels are mutual TLS); never the internal CA."""
    from tandem.security.tls import TlsConfig

    files = (args.public_tls_cert, args.public_tls_key, args.public_tls_client_ca)
    return TlsConfig(*(Path(p) if p else None for p in files))


def identities(args):
    from tandem.security.identity import Identities

    return Identities(router=args.router_identity, draft=args.draft_identity)


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=_env("tls_ca", None), help="verify the server against this PEM bundle (TLS)")
    p.add_argument("--tls-cert", default=_env("tls_cert", None), help="present this PEM certificate (mutual TLS)")
    p.add_argument("--tls-key", default=_env("tls_key", None), help="the key of --tls-cert")
    p.add_argument("--tls-dir", default=_env("tls_dir", None),
                   help="a `tandem certs create` folder: ca.pem, client.pem and client-key.pem unless given above")


def cmd_certs(args) -> int:
    from tandem.security.certs import create_dir

    for path in create_dir(Path(args.dir), hosts=args.host, days=args.days, split=args.split):
        print(path)
    return 0


def certs_parser(sub) -> None:
    from tandem.security.certs import VALID_DAYS

    p = sub.add_parser("certs", help="development certificates for TLS and mutual TLS between the services")
    p.add_argument("action", choices=["create"])
    p.add_argument("dir", help="folder for ca.pem and {router,target,draft,client}.pem with their -key.pem")
    p.add_argument("--host", action="append", default=[],
                   help="another name or address the services are dialled by (localhost, 127.0.0.1 and ::1 are in)")
    p.add_argument("--days", type=int, default=VALID_DAYS)
    p.add_argument("--split", action="store_true",
                   help="each identity's pair and ca.pem in DIR/<identity>/ (one folder to give each service; the CA's"
                        " key stays in DIR)")
    p.set_defaults(func=cmd_certs)
