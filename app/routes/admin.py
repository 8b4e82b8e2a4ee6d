"""The admin's pages besides accounts: the audit log (with a CSV export), the folders
watched folders may be in, and the workers (this machine's and those that joined). The door
(app/accounts/door.py) lets only admins reach /admin."""

from __future__ import annotations

import csv
import io
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from app import audit
from app.accounts import service as accounts
from app.audit import Action, Filter, record_request
from app.contract.workers import HEARTBEAT_EVERY_S, ONLINE_WITHIN_S
from app.db import MAX_ROW_ID, RowId, SessionDep
from app.services import allowed_folders as folders
from app.services.errors import InvalidInput
from app.services.workers import worker_rows
from app.settings import settings

from .templating import render

router = APIRouter()

PAGE_SIZE = 50
CSV_MOST = 100_000
# A spreadsheet runs a cell that starts with one of these as a formula (OWASP "CSV
# injection"): a document named "=HYPERLINK(...)" must stay text in the export.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _filter(user: str, action: str, before: str) -> Filter:
    """The page's query, with anything that is not a known account, action or number left
    out (so a hand-edited address shows everything rather than an error)."""
    return Filter(
        user_id=_row_id(user),
        action=action if action in Action.__members__ else None,
        before_id=_row_id(before),
    )


def _row_id(text: str) -> int | None:
    """A row id written in ASCII digits, within what an id column holds; else None."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_ROW_ID)):
        return None
    return int(text) if int(text) <= MAX_ROW_ID else None


@router.get("/admin/audit", name="audit_log")
def audit_log(request: Request, session: SessionDep, user: str = "", action: str = "",
              before: str = "") -> Response:
    wanted = _filter(user, action, before)
    rows = audit.events(session, wanted, limit=PAGE_SIZE + 1)
    older = None
    if len(rows) > PAGE_SIZE:
        rows = rows[:PAGE_SIZE]
        query = {"user": user, "action": wanted.action or "", "before": rows[-1].id}
        older = "/admin/audit?" + urlencode({k: v for k, v in query.items() if v})
    export = {"user": user if wanted.user_id else "", "action": wanted.action or ""}
    context = {
        "events": rows,
        "older": older,
        "wanted": wanted,
        "users": accounts.list_users(session),
        "actions": list(Action),
        "csv_url": "/admin/audit.csv?" + urlencode({k: v for k, v in export.items() if v}),
    }
    return render(request, "admin_audit.html", context)


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


@router.get("/admin/audit.csv", name="audit_csv")
def audit_csv(session: SessionDep, user: str = "", action: str = "") -> Response:
    """The log (or the page's filter of it) for a spreadsheet, newest first, times in UTC."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["time (UTC)", "who", "what", "subject", "detail", "address"])
    for event in audit.events(session, _filter(user, action, ""), limit=CSV_MOST):
        writer.writerow([_cell(v) for v in (
            event.at.isoformat(timespec="seconds"), event.actor, event.label, event.subject,
            event.detail, event.address)])
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8", headers={
        "Content-Disposition": 'attachment; filename="doctune-audit-log.csv"'})


def _folders_page(request: Request, session: SessionDep, errors: dict[str, str] | None = None,
                  path: str = "", status_code: int = 200) -> Response:
    context = {"folders": folders.folder_rows(session), "errors": errors or {}, "path": path,
               "inbox_dir": settings.inbox_dir}
    return render(request, "admin_folders.html", context, status_code=status_code)


@router.get("/admin/folders", name="allowed_folders")
def allowed_folders_page(request: Request, session: SessionDep) -> Response:
    return _folders_page(request, session)


@router.post("/admin/folders", name="allow_folder")
def allow_folder(request: Request, session: SessionDep,
                 path: Annotated[str, Form()] = "") -> Response:
    visitor = request.state.visitor
    try:
        row = folders.add_folder(session, path, visitor.name)
    except InvalidInput as exc:
        return _folders_page(request, session, exc.errors, path, status_code=422)
    record_request(request, session, Action.folder_allowed, row.path)
    return RedirectResponse("/admin/folders", status_code=303)


@router.post("/admin/folders/{folder_id}/remove", name="remove_folder")
def remove_folder(request: Request, session: SessionDep, folder_id: RowId) -> Response:
    row = folders.remove_folder(session, folder_id)
    record_request(request, session, Action.folder_removed, row.path)
    return RedirectResponse("/admin/folders", status_code=303)


@router.get("/admin/workers", name="workers")
def workers_page(request: Request, session: SessionDep) -> Response:
    context = {"workers": worker_rows(session), "heartbeat_s": HEARTBEAT_EVERY_S,
               "online_within_s": ONLINE_WITHIN_S}
    return render(request, "admin_workers.html", context)
