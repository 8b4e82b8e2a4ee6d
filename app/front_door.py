"""The front door: every request passes here first, whatever address DocTune is bound to.

Why it exists: DocTune listens on the user's own machine, and any web page the user visits can
send requests to a loopback port. With DNS rebinding, a page on `evil.test` (a name its owner
later points at 127.0.0.1) sends `Host: evil.test:8000` and `Origin: http://evil.test:8000`:
the two agree, so comparing Origin with the request's own Host proves nothing. So, in order:

1. **Host** must be a loopback name (127.0.0.1, localhost, [::1]), the bound address, or a name
   listed in DOCTUNE_ALLOWED_HOSTS, with the configured port or none. Otherwise 400.
2. **Unsafe methods** (anything but GET, HEAD, OPTIONS) must carry an `Origin` from a fixed list
   built from those names, the scheme DocTune serves (https once DOCTUNE_TLS_CERTFILE is set,
   and then only https) and the configured port; when a browser leaves Origin out,
   `Sec-Fetch-Site: same-origin` stands in for it. Missing or foreign: 403. Scripts that call
   the JSON API send `Origin: http://127.0.0.1:8000` (or the address they use), or an API
   token (`Authorization: Bearer`, no cookie), which needs no Origin: OpenAI clients send none.
3. **Request size**: a declared Content-Length over the cap is refused before the body is read,
   and a body without one is counted as it arrives (413). Only a multipart POST to the upload
   route gets the large cap (DOCTUNE_MAX_REQUEST_MB); every other request is a small form or
   nothing.
4. **Response headers** on everything, errors included: a CSP with no inline script or style
   (`templates/base.html` tells htmx not to inject its indicator style), no framing, nosniff,
   and a same-origin referrer policy (`no-referrer` would make Chromium send `Origin: null` on
   the app's own form posts).

Refusals are in words, as a page or (under /api/) as JSON. Websockets are refused outright: the
app has none, and a future one must not slip past the checks here."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from fastapi import HTTPException
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.contract.chat import openai_error
from app.lan import LOOPBACK_NAMES, scheme
from app.routes.templating import message_page
from app.services.uploads import human_size
from app.settings import settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
WILDCARD_BINDS = ("", "0.0.0.0", "::")
# Every request but an upload is a small form (or nothing): 1 MiB is plenty.
SMALL_BODY_BYTES = 1024 * 1024
LARGE_BODY_PATHS = re.compile(r"/projects/\d+/documents")

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
    "object-src 'none'"
)
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


class RequestTooLarge(HTTPException):
    """A body that grew past its cap while being read (FastAPI's own HTTPException, so that
    form parsing passes it on instead of turning it into a 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=413, detail=message)


def _split_host(value: str) -> tuple[str, int | None] | None:
    """("name", port or None) from a Host header or a list entry; None when malformed."""
    if not value or any(ch in value for ch in "/?#@\\ ") or value != value.strip():
        return None
    try:
        parts = urlsplit("//" + value)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name:
        return None
    return name.lower(), port


def _origin_key(value: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an Origin header, the default port filled in; None if not one."""
    try:
        parts = urlsplit(value)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not name or parts.path or parts.query:
        return None
    return parts.scheme, name.lower(), port or (443 if parts.scheme == "https" else 80)


def _token_request(scope: Scope, headers: Headers) -> bool:
    """An API call with a personal token (Authorization: Bearer) and no cookie: a browser
    attaches neither to a cross-site request by itself (a script of another site would need
    the token, and a CORS preflight DocTune never answers), so it needs no Origin; the
    accounts door checks the token."""
    path = scope.get("path", "")
    return (path.startswith(("/api/", "/v1/"))
            and headers.get("authorization", "").lower().startswith("bearer ")
            and "cookie" not in headers)


def _url_host(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def allowed_names() -> frozenset[str]:
    """The host names DocTune answers to; ValueError (at start-up) for a malformed setting."""
    names = list(LOOPBACK_NAMES)
    bound = settings.host.strip().lower().strip("[]")
    if bound not in WILDCARD_BINDS:
        names.append(bound)
    for entry in settings.allowed_host_names:
        parsed = _split_host(entry)
        if parsed is None or parsed[1] is not None:
            raise ValueError(
                f"DOCTUNE_ALLOWED_HOSTS: {entry!r} is not a host name; list names only "
                "(DocTune answers on DOCTUNE_PORT), separated by commas."
            )
        names.append(parsed[0])
    return frozenset(names)


class FrontDoor:
    """ASGI middleware: Host allow-list, Origin check, body cap, security headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.port = settings.port
        self.names = allowed_names()
        bound = settings.host.strip().lower().strip("[]")
        served = scheme()  # the one scheme this server speaks: never the request's own
        self.origins = frozenset((served, name, self.port) for name in self.names)
        home = bound if bound not in WILDCARD_BINDS else "127.0.0.1"
        self.home = f"{served}://{_url_host(home)}:{self.port}"  # named in refusals
        self.large_body_bytes = settings.max_request_mb * 1024 * 1024

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            await self._error(scope, receive, send_with_headers, status, message)
            return

        cap = self._cap(scope)
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise RequestTooLarge(self._too_large(scope))
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_headers(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except RequestTooLarge as exc:  # raised where no handler of the app saw it
            if started:
                return
            await self._error(scope, receive, send_with_headers, 413, exc.detail)

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host", "")
        parsed = _split_host(host)
        if parsed is None or parsed[0] not in self.names or parsed[1] not in (None, self.port):
            shown = host[:100] or "no name at all"
            message = (
                f"DocTune does not answer to the address “{shown}”. Open it at {self.home}/ "
                "instead. To reach it from other computers, add this machine's name to "
                "DOCTUNE_ALLOWED_HOSTS and restart DocTune."
            )
            server = scope.get("server")
            if server and server[1] != self.port:  # started by hand with another --port
                message += (
                    f" (This server listens on port {server[1]} but DOCTUNE_PORT is {self.port}: "
                    "set DOCTUNE_PORT to the port you start it on.)"
                )
            return 400, message
        if scope["method"] not in SAFE_METHODS:
            origin = headers.get("origin")
            if origin is None:
                vouched = (headers.get("sec-fetch-site") == "same-origin"
                           or _token_request(scope, headers))
                if not vouched:
                    return 403, (
                        "Changes are accepted only from DocTune's own pages, and this request "
                        "did not say where it came from. Use the page in a browser; a script "
                        f"must send the header “Origin: {self.home}” or an API token."
                    )
            elif _origin_key(origin) not in self.origins:
                return 403, (
                    f"Requests from other web sites are not accepted (this one came from "
                    f"“{origin[:100]}”). Make the change on DocTune's own page, at {self.home}/."
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "The request's size header is not a number."
            if int(length) > self._cap(scope):
                return 413, self._too_large(scope)
        return None

    def _is_upload(self, scope: Scope) -> bool:
        """A file upload: a multipart POST to the upload route. Any other body there is a
        small form (the accounts door reads a plain form whole for its CSRF field)."""
        return (
            scope["method"] == "POST"
            and LARGE_BODY_PATHS.fullmatch(scope["path"]) is not None
            and Headers(scope=scope).get("content-type", "").lower().startswith(
                "multipart/form-data")
        )

    def _cap(self, scope: Scope) -> int:
        return self.large_body_bytes if self._is_upload(scope) else SMALL_BODY_BYTES

    def _too_large(self, scope: Scope) -> str:
        cap = human_size(self._cap(scope))
        if not self._is_upload(scope):
            return f"This request is too large: at most {cap} is accepted here."
        return (
            f"This upload is too large: one upload may hold up to {cap} in all. "
            "Nothing was saved. Please send the files in several smaller uploads."
        )

    async def _error(
        self, scope: Scope, receive: Receive, send: Send, status: int, message: str
    ) -> None:
        request = Request(scope, receive)
        path = scope.get("path", "")
        response: Response
        if path.startswith("/v1/"):  # OpenAI's error shape, which its clients read
            response = JSONResponse(openai_error(status, message), status_code=status)
        elif path.startswith("/api/") or path == "/healthz":
            response = JSONResponse({"detail": message}, status_code=status)
        else:
            title = {400: "Wrong address", 403: "Not allowed", 413: "Too large"}[status]
            response = message_page(request, title, message, status)
        await response(scope, receive, send)
