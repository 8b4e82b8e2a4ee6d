"""One way of writing a value, so that scoring does not fail a reply for its spelling.

A model that says "seven years", "7 years", "£7,895", "09:30", "32kg" or "March 9, 2022" has
given the answer "seven years", "7 years", "7895", "9:30", "32 kg" or "9 March 2022". Before
this, scoring (worker.dataset.probes.gives_answer) failed such replies: the card's and the
colleague questions' alike. `value_form` rewrites casefolded text into one form; scoring
compares both sides in it. Only spellings that cannot change the value are merged: a number
word is its figure, a thousands comma or a time's leading zero is dropped, a unit or an
ordinal suffix is cut from its number, a month-first date is turned day-first, and a span of
time is one way whether it is a noun or hyphened before one ("36 months", "a 36-month
warranty": "36 month"). Nothing rounds, converts a unit or reads "a dozen". Pure Python.
"""

from __future__ import annotations

import re

_ONES = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen",
]  # fmt: skip
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_WORD_VALUE = {w: i for i, w in enumerate(_ONES)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
# "twenty-six", "twenty six", "seven", "forty": a tens word may take a ones word after it
# ("no one" is nobody).
_NUMBER_WORD = re.compile(
    rf"(?<!\bno )\b(?:({'|'.join(_TENS)})(?:[\s-]({'|'.join(_ONES[1:10])}))?|({'|'.join(_ONES)}))\b"
)
# Units and clock words a figure is written against ("32kg", "7:45am", "43p"): cut from it.
_UNITS = "kg|g|mg|mm|cm|m|km|l|ml|am|pm|h|hr|hrs|min|mins|mbar|bar|p|kw|w|v|mb|gb|tb"
_GLUED_UNIT = re.compile(rf"(?<![\w.-])(\d+(?:[.,:]\d+)*)({_UNITS})\b")
_ORDINAL = re.compile(r"(?<![\w.-])(\d{1,2})(?:st|nd|rd|th)\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_CLOCK_ZERO = re.compile(r"(?<![\d.,:])0(\d:\d\d)\b")
# A figure and a span of time ("36 months", "36-month", "2 days", "a 2-day course"): the
# unit singular, after a space.
_DURATION = re.compile(
    r"(?<![\w.,:])(\d+(?:\.\d+)?)[\s-](second|minute|hour|day|week|month|year)s?\b"
)
_MONTHS = (
    "january|february|march|april|may|june|july|august|september|october|november|december"
)
_MONTH_FIRST = re.compile(rf"\b({_MONTHS}) (\d{{1,2}})\b(?:,? (\d{{4}}))?")


def _number_word(m: re.Match) -> str:
    tens, ones, alone = m.groups()
    if alone:
        return str(_WORD_VALUE[alone])
    return str(_WORD_VALUE[tens] + (_WORD_VALUE[ones] if ones else 0))


def _day_first(m: re.Match) -> str:
    month, day, year = m.groups()
    return f"{day} {month}" + (f" {year}" if year else "")


def value_form(text: str) -> str:
    """`text` (casefolded, whitespace collapsed) with its values written one way."""
    text = _NUMBER_WORD.sub(_number_word, text)
    text = _ORDINAL.sub(r"\1", text)
    text = _GLUED_UNIT.sub(r"\1 \2", text)
    text = _THOUSANDS.sub("", text)
    text = _CLOCK_ZERO.sub(r"\1", text)
    text = _DURATION.sub(r"\1 \2", text)
    return _MONTH_FIRST.sub(_day_first, text)
