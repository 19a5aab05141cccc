"""The Starlette application: routes, request ids, API key, error mapping, engine lifecycle.

The app starts answering at once; the engine loads in the background (GET /health says 503
until it is ready, generation routes answer 503 too). Every response carries `x-request-id`
(the client's when it sent one).
"""

from __future__ import annotations

import asyncio
import re
import sys
import uuid
from contextlib import asynccontextmanager
from typing import Awaitable, Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ninfer.engine import AsyncEngine, QueueFullError
from ninfer.ledger import format_ledger
from ninfer.server import routes_admin, routes_anthropic, routes_chat, routes_completions
from ninfer.server.errors import ApiError, error_response
from ninfer.server.request_log import log_stats_forever
from ninfer.server.state import ServerState

EngineFactory = Callable[[], Awaitable[AsyncEngine]]
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_OPEN_PATHS = ("/health", "/metrics", "/static", "/favicon.ico")


class RequestContext:
    """Pure ASGI middleware: assigns the request id, checks the API key, stamps x-request-id, counts
    errors, and counts a client that leaves before its whole response was sent as a client cancel
    (one that leaves before or while its body is read ends the request quietly: nobody is left to
    answer, and it is no server error)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        metrics = self.state.metrics
        progress = {"body_read": False, "sent": False, "left": None}

        async def receive_watched():
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                progress["body_read"] = True
            elif message["type"] == "http.disconnect" and not progress["sent"] and progress["left"] is None:
                progress["left"] = "response" if progress["body_read"] else "body"
            return message

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                hs = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                hs.append((b"x-request-id", rid.encode()))
                message = dict(message, headers=hs)
                if message["status"] >= 400:
                    metrics.http_error(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress["sent"] = True
            await send(message)

        if self.state.api_key and not self._authorized(scope["path"], headers):
            err = ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")
            return await error_response(err)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive_watched, send_with_id)
        except ClientDisconnect:
            pass  # raised by reading the body of a client that has left
        finally:
            if progress["left"] is not None:
                metrics.client_cancelled(progress["left"])

    def _authorized(self, path: str, headers: dict) -> bool:
        if path == "/" or path.startswith(_OPEN_PATHS):
            return True
        key = self.state.api_key
        auth = headers.get("authorization", "")
        return auth == f"Bearer {key}" or headers.get("x-api-key") == key


async def _handle(request, exc):
    return error_response(exc)


async def _http_exception(request, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
    return error_response(err)


def build_app(state: ServerState, engine_factory: EngineFactory, *, cors: Optional[list] = None,
              log_stats_interval_s: Optional[float] = None,
              on_load_failure: Optional[Callable[[], None]] = None) -> Starlette:
    """The ASGI app; `engine_factory` is awaited in the background at startup.

    `on_load_failure` lets `ninfer serve` stop the process when the model cannot load, instead
    of answering 503 forever.
    """

    @asynccontextmanager
    async def lifespan(app):
        async def load():
            try:
                state.attach(await engine_factory())
            except Exception as e:
                state.load_error = f"{type(e).__name__}: {e}"
                print(f"ninfer: model load failed: {state.load_error}", file=sys.stderr, flush=True)
                if on_load_failure is not None:
                    on_load_failure()
                return
            core_info = getattr(state.engine.core, "info", None)
            if core_info is not None:
                print(format_ledger(core_info()), file=sys.stderr, flush=True)
            print(f"ninfer: model {state.defaults.model_id} ready (max context {state.engine.max_context})",
                  file=sys.stderr, flush=True)
            if log_stats_interval_s:
                await log_stats_forever(state.engine, log_stats_interval_s)

        task = asyncio.get_running_loop().create_task(load())
        try:
            yield
        finally:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            if state.engine is not None:
                await state.engine.shutdown()
            if state.request_log is not None:
                state.request_log.close()

    routes = [
        Route("/v1/chat/completions", routes_chat.chat_completions, methods=["POST"]),
        Route("/v1/completions", routes_completions.completions, methods=["POST"]),
        Route("/v1/messages", routes_anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", routes_anthropic.count_tokens, methods=["POST"]),
        Route("/v1/models", routes_admin.models, methods=["GET"]),
        Route("/health", routes_admin.health, methods=["GET"]),
        Route("/metrics", routes_admin.metrics, methods=["GET"]),
        Route("/tokenize", routes_admin.tokenize, methods=["POST"]),
        Route("/detokenize", routes_admin.detokenize, methods=["POST"]),
        Route("/", routes_admin.index, methods=["GET"]),
    ]
    if routes_admin.STATIC_DIR.is_dir():
        routes.append(Mount("/static", app=StaticFiles(directory=routes_admin.STATIC_DIR), name="static"))
    middleware = [Middleware(RequestContext, state=state)]
    if cors:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"]))
    handlers = {HTTPException: _http_exception, Exception: _handle, ApiError: _handle, QueueFullError: _handle,
                ValueError: _handle}
    try:
        from ninfer import _core

        handlers[_core.NinferError] = _handle
    except ImportError:
        pass
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = state
    return app

