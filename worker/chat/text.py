"""A reply's text as its tokens arrive."""

from __future__ import annotations


class TextStream:
    """The reply's text as it grows: decoding all ids each time and handing on the new
    end, except a trailing partial character (a byte-level token that starts a UTF-8
    sequence decodes to U+FFFD until the rest arrives)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        return self._new(text)

    def flush(self) -> str:
        return self._new(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _new(self, text: str) -> str:
        if not text.startswith(self.sent):  # a tokenizer that rewrites earlier text
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
