"""The web app: `uvicorn app.main:app`. Pages for people, a small JSON API for scripts."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.routes import api, pages
from app.routes.templating import message_page
from app.services.errors import InvalidInput, NotFound

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"

_TITLES = {
    400: "That request could not be understood",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed",
    413: "Too large",
    422: "Please check your input",
    500: "Something went wrong",
}


class SameOriginPosts:
    """Refuse state-changing requests sent by other web sites (cross-site request forgery).

    DocTune listens on the user's own machine, so any page the user visits could post a
    form to it; browsers label such requests with an Origin header we can check."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            headers = {k.lower(): v for k, v in scope["headers"]}
            origin = headers.get(b"origin", b"").decode("latin-1")
            host = headers.get(b"host", b"").decode("latin-1")
            if origin and urlsplit(origin).netloc != host:
                response = JSONResponse(
                    {"detail": "Requests from other web sites are not accepted."}, status_code=403
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/") or request.url.path == "/healthz"


def _error(request: Request, status_code: int, message: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"detail": message}, status_code=status_code)
    title = _TITLES.get(status_code, "Something went wrong")
    return message_page(request, title, message, status_code)


def create_app() -> FastAPI:
    app = FastAPI(
        title="DocTune",
        summary="Fine-tune a language model on your own documents, on your own machine.",
        docs_url=None,  # the interactive docs load scripts from a CDN; DocTune works offline
        redoc_url=None,
    )
    app.add_middleware(SameOriginPosts)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(pages.router)
    app.include_router(api.router)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> Response:
        return _error(request, 404, exc.message)

    @app.exception_handler(InvalidInput)
    async def _invalid(request: Request, exc: InvalidInput) -> Response:
        return _error(request, 422, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = "There is no page at this address."
        elif exc.status_code == 405:
            message = "This address does not accept that kind of request."
        else:
            message = str(exc.detail)
        return _error(request, exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> Response:
        if any(err.get("loc", ("",))[0] == "path" for err in exc.errors()):
            return _error(request, 404, "There is no page at this address.")
        return _error(request, 422, "Some of the information sent was not valid. Please try again.")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(
            request,
            500,
            "DocTune hit an unexpected problem and could not finish this. Your data is safe; "
            "please try again, and if it keeps happening, restart DocTune.",
        )

    return app


app = create_app()
