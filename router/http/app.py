"""The router's OpenAI-compatible HTTP API: an aiohttp application on the router's own event
loop, beside the gRPC port and on the same engine (no second scheduler): POST
/v1/chat/completions and /v1/completions (router.http.completions), GET /v1/models and
/health. The gRPC port's API keys and public TLS certificate guard it too; /health is open, as
the gRPC health service is."""

import json
import logging
import ssl
from pathlib import Path

from aiohttp import web

from router.http import completions
from router.http.errors import HttpError, model_not_found, unauthenticated
from router.http.openai_request import CHAT, COMPLETION
from tandem.grpc_server import PUBLIC_MAX_MESSAGE_BYTES
from tandem.security.api_keys import ApiKeys, key_id

log = logging.getLogger(__name__)

SHUTDOWN_S = 1.0  # stop(): handlers still running then are cancelled (their requests too)
_BEARER = "bearer "


class HttpApi:
    """One router's HTTP server: start(), stop(). While the engine drains, /health answers 503
    and the engine refuses new requests (503)."""

    def __init__(self, engine, api_keys: ApiKeys | None, model_name: str):
        self.engine, self.api_keys, self.model_name = engine, api_keys, model_name
        self.port = 0
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        # A body as large as the gRPC port takes: the request limits (--max-prompt-bytes) name
        # the field past them; past this one, 413.
        app = web.Application(middlewares=[self._guard], client_max_size=PUBLIC_MAX_MESSAGE_BYTES)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listens on host:port; returns the bound port. A client that disconnects cancels its
        handler (handler_cancellation), and with it its request."""
        self._runner = web.AppRunner(self.application(), handler_cancellation=True, shutdown_timeout=SHUTDOWN_S,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def check_model(self, model: str | None) -> None:
        """An unset model is this server's; another name is 404."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """API keys on /v1/, and every refusal in OpenAI's error shape (aiohttp's own 404, 405
        and 413 included)."""
        try:
            if request.path.startswith("/v1/"):
                self._authorize(request)
            return await handler(request)
        except HttpError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return HttpError(e.status, f"{request.method} {request.path}: {e.reason}", code=None).response()

    def _authorize(self, request: web.Request) -> None:
        if self.api_keys is None:
            return
        value = request.headers.get("Authorization", "")
        if value[:len(_BEARER)].lower() != _BEARER:
            raise unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        key = value[len(_BEARER):].strip()
        if not self.api_keys.valid(key):
            log.info("refused %s: unknown API key %s", request.path, key_id(key))
            raise unauthenticated("invalid API key")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await completions.generate(self, request, CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await completions.generate(self, request, COMPLETION)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self.check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": self.engine.info.max_context_length}

    async def _health(self, request: web.Request) -> web.Response:
        """200 while the router can serve (its target up, serving its model, not draining)."""
        if self.engine.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine.serving:
            return web.json_response({"status": "not serving"}, status=503)
        return web.json_response({"status": "serving"})


def served_model_name(model_dir: Path, configured: str = "") -> str:
    """The name clients send as `model`: the configured one, else the name the model's
    config.json records (tandem models fetch writes it; a dtype folder's own name says little),
    else its folder's."""
    if configured:
        return configured
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    name = config.get("_model_name_or_path") or config.get("_name_or_path") if isinstance(config, dict) else None
    return Path(name).name if isinstance(name, str) and name else Path(model_dir).name
