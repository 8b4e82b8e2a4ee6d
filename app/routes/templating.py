"""Jinja2 setup: one URL serves a page, or only the named block(s) htmx asked for."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from jinja2_fragments.fastapi import Jinja2Blocks

from app.lan import crosses_network_unencrypted
from app.services.durations import human_duration
from app.services.jobs import format_number
from app.services.uploads import human_size

TEMPLATES_DIR = Path(__file__).resolve().parent.parent.parent / "templates"

templates = Jinja2Blocks(directory=str(TEMPLATES_DIR))
templates.env.trim_blocks = True
templates.env.lstrip_blocks = True


def _local_time(value: datetime | None) -> str:
    """Stored times are naive UTC; show them in the machine's own time zone."""
    if value is None:
        return "—"
    local = value.replace(tzinfo=UTC).astimezone()
    return local.strftime("%d %b %Y, %H:%M")


def _pct(value: float | None, digits: int = 0) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.{digits}f}%"


def _fixed(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:,.{digits}f}"


def _shorten(text: str, limit: int = 80) -> str:
    """Keep both ends of a long name (the extension matters): "very-long…name.pdf"."""
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    return text[:head] + "…" + text[-(limit - 1 - head) :]


templates.env.filters.update(
    human_size=human_size,
    local_time=_local_time,
    duration=human_duration,
    num=format_number,
    pct=_pct,
    fixed=_fixed,
    shorten=_shorten,
)


def is_htmx(request: Request) -> bool:
    """An htmx request for part of a page (a history restore wants the whole page)."""
    return (
        request.headers.get("HX-Request") == "true"
        and request.headers.get("HX-History-Restore-Request") != "true"
    )


def hx_target(request: Request) -> str | None:
    return request.headers.get("HX-Target") if is_htmx(request) else None


def render(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    blocks: list[str] | None = None,
    status_code: int = 200,
) -> Response:
    """The whole page, or just `blocks` of it (in order) for an htmx request."""
    visitor = getattr(request.state, "visitor", None)  # who app/accounts/door.py let in
    unencrypted = crosses_network_unencrypted(request.url.scheme, request.headers.get("host", ""))
    context = {"visitor": visitor, "csrf_token": visitor.csrf_token if visitor else "",
               "unencrypted_lan": unencrypted, **context}
    headers = {"Vary": "HX-Request, HX-Target"}
    if blocks and is_htmx(request):
        return templates.TemplateResponse(
            request, name, context, status_code=status_code, headers=headers, block_names=blocks
        )
    return templates.TemplateResponse(
        request, name, context, status_code=status_code, headers=headers
    )


def message_page(request: Request, title: str, message: str, status_code: int) -> Response:
    """An error or notice: a whole page, or for htmx a short note that replaces the target."""
    context = {"title": title, "message": message, "status_code": status_code}
    return render(request, "error.html", context, blocks=["message"], status_code=status_code)
