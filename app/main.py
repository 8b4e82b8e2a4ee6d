"""The web app: `uvicorn app.main:app`. Pages for people, a small JSON API for scripts."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from app.accounts.door import SignInRequired, door
from app.contract.chat import openai_error
from app.front_door import FrontDoor, allowed_names
from app.routes import accounts, admin, api, chat, openai_api, pages
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


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith(("/api/", "/v1/")) or request.url.path == "/healthz"


def _openai_error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(openai_error(status_code, message), status_code=status_code)


def _error(request: Request, status_code: int, message: str) -> Response:
    if request.url.path.startswith("/v1/"):
        return _openai_error(status_code, message)
    if _wants_json(request):
        return JSONResponse({"detail": message}, status_code=status_code)
    title = _TITLES.get(status_code, "Something went wrong")
    return message_page(request, title, message, status_code)


class DocTune(FastAPI):
    """FastAPI with the front door outside everything, even the handler that renders 500s,
    so that no response (a crash page included) leaves without its security headers."""

    def build_middleware_stack(self) -> ASGIApp:
        return FrontDoor(super().build_middleware_stack())


def create_app() -> FastAPI:
    allowed_names()  # a malformed DOCTUNE_ALLOWED_HOSTS stops the start, not the first request
    app = DocTune(
        title="DocTune",
        summary="Fine-tune a language model on your own documents, on your own machine.",
        docs_url=None,  # the interactive docs load scripts from a CDN; DocTune works offline
        redoc_url=None,
        openapi_url=None,  # no schema for anonymous readers either (the door covers routes)
        # On the app itself, so that every route, one added later included, goes through it
        # (tests/app/test_accounts.py walks app.routes to check).
        dependencies=[Depends(door)],
    )
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(pages.router)
    app.include_router(api.router)
    app.include_router(accounts.router)
    app.include_router(admin.router)
    app.include_router(chat.router)
    app.include_router(openai_api.router)

    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, exc: SignInRequired) -> Response:
        if _wants_json(request):
            words = "Sign in, or send an API token (Authorization: Bearer ...)."
            response = (_openai_error(401, words) if request.url.path.startswith("/v1/")
                        else JSONResponse({"detail": words}, status_code=401))
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        to = "/signin?" + urlencode({"next": request.url.path})
        if request.headers.get("HX-Request") == "true":  # htmx: go to the page, not swap it
            return Response(status_code=401, headers={"HX-Redirect": to})
        return RedirectResponse(to, status_code=303)

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
