"""Question-answer pairs from CSV and JSONL files (standard library csv and json).

Columns and keys are recognised by name, case-insensitively: a question is "question", "q",
"prompt", "instruction", "input" or "query"; an answer is "answer", "a", "response",
"output", "completion" or "reply". Alpaca-style records with both "instruction" and "input"
get the input appended to the question. JSONL also takes chat records
({"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}, or ShareGPT's
"conversations" with "from"/"value").
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path

from worker.extract.common import (
    NO_TEXT,
    Extracted,
    ExtractionError,
    ReadContext,
    normalize_text,
    read_limited,
)
from worker.extract.text import decode_text

log = logging.getLogger(__name__)

QUESTION_NAMES = ("question", "questions", "q", "prompt", "instruction", "input", "query")
ANSWER_NAMES = ("answer", "answers", "a", "response", "output", "completion", "reply")
_USER_ROLES = frozenset(("user", "human"))
_ASSISTANT_ROLES = frozenset(("assistant", "gpt", "bot", "model"))
_DELIMITERS = (",", ";", "\t", "|")

EXPECTED_COLUMNS = (
    'Name the columns "question" and "answer" (prompt/response and instruction/output work '
    "too), or use a file with exactly two columns: question first, answer second."
)
EXPECTED_JSONL = 'Each line should be one JSON object such as {"question": "...", "answer": "..."}.'
ALL_EMPTY = "No question-answer pairs found: every row had an empty question or answer."


def _columns(header: list[str]) -> tuple[int, int, int | None] | None:
    """(question, answer, extra input) column positions found by name, or None."""
    names = [h.strip().strip("\ufeff").strip().lower() for h in header]

    def find(wanted: tuple[str, ...]) -> int | None:
        for want in wanted:
            if want in names:
                return names.index(want)
        return None

    q, a = find(QUESTION_NAMES), find(ANSWER_NAMES)
    if q is None or a is None or q == a:
        return None
    extra = names.index("input") if names[q] == "instruction" and "input" in names else None
    return q, a, extra


def _join_question(question: str, extra: str) -> str:
    return f"{question}\n\n{extra}" if extra.strip() else question


def _skipped_note(n: int, unit: str) -> str:
    return f"Skipped {n} {unit}{'s' if n != 1 else ''} with an empty question or answer."


# --- CSV ----------------------------------------------------------------------------------


def extract_csv(path: Path, ctx: ReadContext) -> Extracted:
    budget = ctx.budget
    text = decode_text(read_limited(path))
    if not text.strip():
        raise ExtractionError(NO_TEXT)
    delimiter, header = _sniff(text)
    found = _columns(header)
    warnings: list[str] = []
    skip_first = True
    if found is None:
        if len([h for h in header if h.strip()]) != 2 or len(header) != 2:
            shown = ", ".join(f'"{h.strip()}"' for h in header[:8] if h.strip()) or "none"
            raise ExtractionError(
                f"This CSV file has no question and answer columns (its columns: {shown}). "
                + EXPECTED_COLUMNS
            )
        found = (0, 1, None)
        skip_first = _looks_like_headings(header)
        if skip_first:
            warnings.append(
                f'Read the first row ("{header[0].strip()}", "{header[1].strip()}") as '
                "column headings."
            )

    q_col, a_col, extra_col = found
    pairs: list[tuple[str, str]] = []
    skipped = 0
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        for i, row in enumerate(reader):
            if i == 0 and skip_first:
                continue
            if not any(cell.strip() for cell in row):
                continue
            question = _cell(row, q_col)
            if extra_col is not None:
                question = _join_question(question, _cell(row, extra_col))
            answer = _cell(row, a_col)
            if not question or not answer:
                skipped += 1
                continue
            budget.add(question)
            budget.add(answer)
            pairs.append((question, answer))
    except csv.Error as exc:
        log.info("csv error in %s: %s", path, exc)
        raise ExtractionError(
            f"Could not read the CSV file at line {reader.line_num}; check that line for a "
            'quote mark (") that is opened but never closed, or a cell of more than '
            "130,000 characters."
        ) from exc
    if not pairs:
        raise ExtractionError(ALL_EMPTY if skipped else "No question-answer rows found.")
    if skipped:
        warnings.append(_skipped_note(skipped, "row"))
    return Extracted(text="", qa_pairs=pairs, warnings=warnings)


def _cell(row: list[str], index: int) -> str:
    return normalize_text(row[index]) if index < len(row) else ""


def _sniff(text: str) -> tuple[str, list[str]]:
    """Pick the separator (comma, semicolon, tab, bar) from the first row: one that shows
    question/answer headings wins, else the one that splits the row into the most columns."""
    best: tuple[tuple[bool, int], str, list[str]] | None = None
    for delimiter in _DELIMITERS:
        try:
            header = next(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter), [])
        except csv.Error:
            continue
        score = (_columns(header) is not None, len(header))
        if best is None or score > best[0]:
            best = (score, delimiter, header)
    if best is None:
        raise ExtractionError(
            "Could not read the first line of this CSV file; check it for an unclosed quote "
            'mark ("). ' + EXPECTED_COLUMNS
        )
    return best[1], best[2]


def _looks_like_headings(row: list[str]) -> bool:
    """A first row like "Term, Definition" rather than a real question and answer."""
    cells = [c.strip() for c in row]
    return all(cells) and all(len(c) <= 40 and "?" not in c for c in cells)


# --- JSONL --------------------------------------------------------------------------------


class _BadRecord(Exception):
    """One JSONL line we can't use; the message finishes "Line N of this file ..."."""


def extract_jsonl(path: Path, ctx: ReadContext) -> Extracted:
    budget = ctx.budget
    text = decode_text(read_limited(path))
    if not text.strip():
        raise ExtractionError(NO_TEXT)
    records, unit = _records(text)
    pairs: list[tuple[str, str]] = []
    skipped = 0
    bad: list[tuple[int, str]] = []
    for line_no, record in records:
        try:
            if isinstance(record, _BadRecord):
                raise record
            found = _pairs_from_record(record)
        except _BadRecord as exc:
            bad.append((line_no, str(exc)))
            continue
        for question, answer in found:
            if not question or not answer:
                skipped += 1
                continue
            budget.add(question)
            budget.add(answer)
            pairs.append((question, answer))

    if bad and len(bad) * 2 > len(records):
        line_no, reason = bad[0]
        raise ExtractionError(
            f"{unit} {line_no} of this file {reason}, and so do {len(bad) - 1} more of its "
            f"{len(records)} {unit.lower()}s. {EXPECTED_JSONL}"
            if len(bad) > 1
            else f"{unit} {line_no} of this file {reason}. {EXPECTED_JSONL}"
        )
    warnings = []
    if bad:
        what = (
            f"{len(bad)} {unit.lower()}s that were"
            if len(bad) > 1
            else f"1 {unit.lower()} that was"
        )
        warnings.append(
            f"Skipped {what} not a question-answer record "
            f"(the first is {unit.lower()} {bad[0][0]})."
        )
    if not pairs:
        raise ExtractionError(ALL_EMPTY if skipped else "No question-answer records found.")
    if skipped:
        warnings.append(_skipped_note(skipped, "record"))
    return Extracted(text="", qa_pairs=pairs, warnings=warnings)


def _records(text: str) -> tuple[list[tuple[int, object]], str]:
    """(line number, parsed JSON or a _BadRecord) for every non-blank line, and "Line". A
    whole file that is one JSON array of records (a common near-miss) is accepted too,
    numbered by "Item"."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            whole = json.loads(stripped)
        except (ValueError, RecursionError):
            whole = None
        if isinstance(whole, list):
            return list(enumerate(whole, 1)), "Item"
    records: list[tuple[int, object]] = []
    # Split on newlines only: str.splitlines would also split inside JSON strings at U+2028.
    for line_no, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            records.append((line_no, json.loads(line)))
        except RecursionError:  # valid JSON, maybe, but nested thousands of levels deep
            records.append((line_no, _BadRecord("nests its values thousands of levels deep")))
        except ValueError:
            records.append((line_no, _BadRecord("is not valid JSON")))
    return records, "Line"


def _pairs_from_record(record: object) -> list[tuple[str, str]]:
    if not isinstance(record, dict):
        raise _BadRecord("is not a JSON object")
    fields = {str(k).strip().lower(): v for k, v in record.items()}
    for key in ("messages", "conversations"):
        if isinstance(fields.get(key), list):
            return _pairs_from_chat(fields[key])
    q_key = next((n for n in QUESTION_NAMES if n in fields), None)
    a_key = next((n for n in ANSWER_NAMES if n in fields), None)
    if q_key is None or a_key is None:
        raise _BadRecord("has no question and answer fields")
    question = _value(fields[q_key])
    if q_key == "instruction" and "input" in fields:
        question = _join_question(question, _value(fields["input"]))
    return [(question, _value(fields[a_key]))]


def _pairs_from_chat(messages: list) -> list[tuple[str, str]]:
    """Each user message followed by an assistant reply is one pair; system turns are
    ignored."""
    pairs = []
    pending: str | None = None
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRecord("has a message that is not a JSON object")
        role = str(message.get("role", message.get("from", ""))).strip().lower()
        content = _value(message.get("content", message.get("value")))
        if role in _USER_ROLES:
            pending = content
        elif role in _ASSISTANT_ROLES and pending is not None:
            pairs.append((pending, content))
            pending = None
    if not pairs:
        raise _BadRecord("has no user message followed by an assistant reply")
    return pairs


def _value(value: object) -> str:
    """A field as text: strings, numbers, or a list of chat content parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, bool):
        raise _BadRecord("has a true/false value where text was expected")
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):  # [{"type": "text", "text": "..."}, ...]
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return normalize_text("\n\n".join(parts))
    raise _BadRecord("has a question or answer that is not text")
