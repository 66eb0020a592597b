"""`tandem up`: the services as local processes, supervised (one that dies is restarted with
backoff while the others serve on), stopped together on Ctrl-C or SIGTERM."""

import argparse
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router.config import LOCAL_DRAFTS
from tandem.client import health
from tandem.models.heads import default_draft, default_shape, device_shape_flags, shipped_head
from tandem.security.tls import PLAINTEXT, TlsConfig

READY_TIMEOUT_S = 300.0


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when `tandem up` dies (even by SIGKILL), so that no
    service outlives it now that they sit in sessions of their own."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(args: list[str], log_level: str, log_format: str = "text") -> subprocess.Popen:
    # A session of its own: the terminal's Ctrl-C reaches `tandem up` alone, which stops the
    # services in order (the router drains first, while the target still serves its steps).
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "--log-level", log_level, "--log-format", log_format, *args],
                            start_new_session=True, preexec_fn=_die_with_parent)


class Stopped(Exception):
    """SIGTERM or Ctrl-C came while the services were starting."""


def wait_healthy(address: str, procs: list[subprocess.Popen], timeout: float = READY_TIMEOUT_S,
                 tls: TlsConfig = PLAINTEXT, stopping=lambda: False) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping():
            raise Stopped()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a service exited before {address} was ready")
        if health(address, timeout=1.0, quiet=True, tls=tls) == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{address} not SERVING after {timeout:.0f} s")


def resolve_up_draft(args) -> argparse.Namespace:
    """--draft auto, an unnamed head and an unset shape made concrete (tandem.models.heads): on
    the default model a draft method without --draft-model takes the shipped head, and EAGLE
    without --shape the device's shape; unset --spec-draft-length, --tree-top-k,
    --tree-node-budget (Medusa's too: the nodes it keeps of its tree) and
    --spec-disable-batch-size take the device's."""
    shape = default_shape(args.device)
    draft = default_draft(args.model is not None) if args.draft == "auto" else args.draft
    chosen = {"draft": draft}
    if draft not in ("none", *LOCAL_DRAFTS) and args.draft_model is None and args.model is None:
        chosen["draft_model"] = shipped_head(draft)
    if draft == "eagle" and args.shape is None:
        chosen["shape"] = shape.shape
    chosen.update(device_shape_flags(args))
    return argparse.Namespace(**{**vars(args), **chosen})


def identity_flags(tls_dir: Path | None, name: str) -> list[str]:
    """`name`'s certificate and key and the CA of a `tandem certs create` folder (none: plaintext)."""
    if tls_dir is None:
        return []
    return ["--tls-cert", str(tls_dir / f"{name}.pem"), "--tls-key", str(tls_dir / f"{name}-key.pem"),
            "--tls-ca", str(tls_dir / "ca.pem")]


def public_tls_flags(tls_dir: Path | None) -> list[str]:
    """TLS on the public port with the router's certificate (clients verify it against the CA)."""
    if tls_dir is None:
        return []
    return ["--public-tls-cert", str(tls_dir / "router.pem"), "--public-tls-key", str(tls_dir / "router-key.pem")]


def client_tls(tls_dir: Path | None) -> TlsConfig:
    """How `tandem up` checks its services' health: as the development client."""
    if tls_dir is None:
        return PLAINTEXT
    return TlsConfig.of_identity(tls_dir, "client")


def router_flags(args) -> list[str]:
    """Every flag the router's command shares with `tandem up` (cli_router.add_router_flags), as given."""
    from tandem.cli_router import router_flag_options

    out = []
    for option, dest in router_flag_options():
        value = getattr(args, dest)
        if value is not None:
            out += [option, str(value)]
    return out


def service_args(args, model: Path) -> tuple[list[str], list[str], list[str] | None]:
    common = ["--model", str(model), "--dtype", args.dtype]
    tls_dir = Path(args.tls_dir) if getattr(args, "tls_dir", None) else None
    target = [
        "target", *common,
        "--host", args.host, "--port", str(args.target_port),
        "--device", args.device,
        "--kv-page-size", str(args.kv_page_size),
        "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--max-num-sequence", str(args.max_num_sequence),
        "--max-context-length", str(args.max_context_length),
        "--threads", str(args.threads),
        "--metrics-port", str(args.target_metrics_port),
        *identity_flags(tls_dir, "target"),
    ]
    router = [
        "router", *common,
        "--host", args.host, "--port", str(args.router_port),
        "--target", f"{args.host}:{args.target_port}",
        *router_flags(args),
        "--spec-draft-length", str(args.spec_draft_length),
        "--spec-disable-batch-size", str(args.spec_disable_batch_size),
        "--metrics-port", str(args.router_metrics_port),
        *identity_flags(tls_dir, "router"),
        *public_tls_flags(tls_dir),
    ]
    draft = None
    if args.draft in LOCAL_DRAFTS:  # the router drafts: no draft service
        router += ["--local-draft", args.draft]
    elif args.draft != "none":
        if not args.draft_model:
            raise SystemExit(f"tandem up --draft {args.draft}: --draft-model DIR is required")
        draft = [
            "draft", *common, "--method", args.draft, "--draft-model", str(args.draft_model),
            "--host", args.host, "--port", str(args.draft_port), "--device", args.device,
            "--target", f"{args.host}:{args.target_port}", "--threads", str(args.threads),
            "--kv-page-size", str(args.kv_page_size), "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--max-num-sequence", str(args.max_num_sequence),
            "--tree-top-k", str(args.tree_top_k), "--tree-node-budget", str(args.tree_node_budget),
            "--proposal-top-k", str(args.proposal_top_k), "--medusa-choices", args.medusa_choices,
            "--draft-lm-head-quant", args.draft_lm_head_quant, "--draft-head-quant", args.draft_head_quant,
            "--metrics-port", str(args.draft_metrics_port),
            *identity_flags(tls_dir, "draft"),
        ]
        if args.shape:
            draft += ["--shape", args.shape]
        router += ["--draft", f"{args.host}:{args.draft_port}"]
    if args.enforce_eager:
        target.append("--enforce-eager")
        draft = draft and [*draft, "--enforce-eager"]
    return target, router, draft


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays before restarting a service that died: `initial_s`, doubled at each death in a
    row up to `cap_s`. A service that stayed up `stable_s` before it died starts afresh (a crash
    loop backs off; a service that dies once a day restarts at once)."""

    initial_s: float = 1.0
    cap_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, deaths_in_a_row: int) -> float:
        return min(self.cap_s, self.initial_s * 2 ** (deaths_in_a_row - 1))


class Supervised:
    """One service's process: `check` finds it dead and restarts it when its backoff is over.
    The router and the draft find a restarted target (or draft) on their own."""

    def __init__(self, name: str, spawn: Callable[[], subprocess.Popen], backoff: Backoff,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.name, self._spawn, self.backoff, self._say, self._clock = name, spawn, backoff, say, clock
        self.proc: subprocess.Popen | None = None
        self.deaths = 0  # in a row, each within stable_s of its start
        self.restarts = 0
        self._started = 0.0
        self._restart_at: float | None = None  # while dead: when it is started again

    def start(self) -> subprocess.Popen:
        self.proc, self._started, self._restart_at = self._spawn(), self._clock(), None
        return self.proc

    def check(self) -> None:
        now = self._clock()
        if self.proc is None:
            if self._restart_at is not None and now >= self._restart_at:
                self.start()
                self.restarts += 1
                self._say(f"tandem up: {self.name} restarted (pid {self.proc.pid})")
            return
        code = self.proc.poll()
        if code is None:
            return
        self.deaths = 1 if now - self._started >= self.backoff.stable_s else self.deaths + 1
        delay = self.backoff.delay(self.deaths)
        self._say(f"tandem up: {self.name} (pid {self.proc.pid}) {_exit_text(code)}; restarting it in {delay:g} s")
        self.proc, self._restart_at = None, now + delay

    def terminate(self) -> None:
        self._restart_at = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def ensure_certs(tls_dir: Path) -> None:
    """A --tls-dir without a CA gets development certificates (tandem certs create)."""
    from tandem.security.certs import create_dir

    if not (tls_dir / "ca.pem").exists():
        create_dir(tls_dir)
        print(f"tandem up: development certificates created in {tls_dir} (tandem certs create)", flush=True)


def run_up(args, model: Path, backoff: Backoff = Backoff()) -> int:
    tls_dir = Path(args.tls_dir) if args.tls_dir else None
    if tls_dir is not None:
        ensure_certs(tls_dir)
    target_args, router_args, draft_args = service_args(args, model)
    plan = [("target", target_args, args.target_port), ("draft", draft_args, args.draft_port),
            ("router", router_args, args.router_port)]
    services: list[Supervised] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for name, service, port in plan:  # in order, each ready before the next needs it
            if service is None:
                continue
            spawn = lambda service=service: _spawn(service, args.log_level, args.log_format)  # noqa: E731
            services.append(Supervised(name, spawn, backoff, lambda line: print(line, flush=True)))
            print(f"tandem up: {name} started (pid {services[-1].start().pid})", flush=True)
            wait_healthy(f"{args.host}:{port}", [s.proc for s in services], tls=client_tls(tls_dir),
                         stopping=lambda: stopping)
        drafting = f"{args.draft} {args.draft_model}, {args.shape or 'its default shape'}, k = {args.spec_draft_length}" \
            if draft_args else f"{args.draft} in the router, k = {args.spec_draft_length}" if args.draft in LOCAL_DRAFTS \
            else "none"
        security = f"; mutual TLS, CA {tls_dir / 'ca.pem'}" if tls_dir else ""
        print(f"tandem up: router on {args.host}:{args.router_port} (draft: {drafting}{security})", flush=True)
        if args.http_port:  # passed through with the router's flags (router_flags)
            scheme = "https" if tls_dir else "http"
            print(f"tandem up: OpenAI-compatible API on {scheme}://{args.host}:{args.http_port}/v1", flush=True)
        while not stopping:
            for service in services:
                service.check()
            time.sleep(0.2)
    except Stopped:
        pass
    finally:
        _terminate(services, args.shutdown_grace_s)
    return 0


STOP_MARGIN_S = 10.0  # beyond the router's grace: the services' own shutdown


def _terminate(services: list[Supervised], grace_s: float) -> None:
    """The router first, waited for: it drains its requests (up to `grace_s`) while the target
    and the draft still serve their steps; then the draft and the target."""
    for service in reversed(services):
        service.terminate()
        service.wait(timeout=grace_s + STOP_MARGIN_S)
