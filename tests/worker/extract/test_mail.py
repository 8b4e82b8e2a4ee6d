"""E-mail extraction (.eml, .mbox) on real messages written by the standard library, with
real attachments (PDF, Word, CSV, a forwarded message), and on broken ones."""

from __future__ import annotations

import mailbox
from pathlib import Path

import pytest

from tests.fixtures import docs
from worker.extract import ExtractionError, extract
from worker.extract.common import NO_TEXT

FACTS = [
    "The Kelmscott Ridge showroom opens on 14 June with 12 staff.",
    "Order code NW-4471 now ships from the Port Ellery warehouse.",
]
PDF_FACT = "The Gale Fan Mk III draws 38 watts at full speed."
DOCX_FACT = "Warranty claims go to claims@northwind.example within 30 days."


def refused(path: Path, kind: str) -> str:
    with pytest.raises(ExtractionError) as info:
        extract(path, kind)
    return str(info.value)


def _pdf_bytes(tmp_path: Path, text: str) -> bytes:
    return docs.make_pdf(tmp_path / "spec.pdf", [text]).read_bytes()


def test_eml_headers_body_and_attachments(tmp_path):
    docx = docs.make_docx(tmp_path / "claims.docx", [DOCX_FACT]).read_bytes()
    faq = b"question,answer\nHow long is the warranty?,Two years on every widget.\n"
    path = docs.make_eml(
        tmp_path / "update.eml",
        FACTS,
        subject="Showroom news",
        attachments=[
            ("spec.pdf", _pdf_bytes(tmp_path, PDF_FACT)),
            ("claims.docx", docx),
            ("faq.csv", faq),
            ("logo.png", b"\x89PNG\r\n\x1a\n" + bytes(40)),
            ("tool.exe", b"MZ" + bytes(100)),
        ],
    )
    result = extract(path, "eml")
    text = result.text
    assert "Subject: Showroom news" in text
    assert "From: Marguerite Olsson-Dray <mod@northwind.example>" in text
    for fact in (*FACTS, PDF_FACT, DOCX_FACT):
        assert fact in text
    assert text.index(FACTS[1]) < text.index("Attachment: spec.pdf") < text.index(PDF_FACT)
    assert result.qa_pairs == [("How long is the warranty?", "Two years on every widget.")]
    assert result.warnings == ["Attachment “tool.exe” skipped: DocTune does not read that type."]


def test_eml_html_only_body_is_read_like_a_web_page(tmp_path):
    path = docs.make_eml(tmp_path / "news.eml", FACTS, html_body=True)
    text = extract(path, "eml").text
    assert all(fact in text for fact in FACTS) and "<p>" not in text


def test_forwarded_message_is_read_and_a_broken_attachment_is_noted(tmp_path):
    inner = docs.make_email(
        ["Inner fact: the Quiet Hinge has a lifetime warranty."], subject="Original"
    )
    outer = docs.make_email(
        ["Forwarding this."],
        subject="Fwd: Original",
        attachments=[("damaged.pdf", b"%PDF-1.4 cut")],
    )
    outer.add_attachment(inner)  # message/rfc822
    path = tmp_path / "fwd.eml"
    path.write_bytes(bytes(outer))
    result = extract(path, "eml")
    assert "Attached message:" in result.text and "lifetime warranty" in result.text
    assert "Subject: Original" in result.text
    assert len(result.warnings) == 1 and "damaged.pdf" in result.warnings[0]


def test_attached_eml_files_nest_only_so_deep(tmp_path):
    message = docs.make_email(["Level 0 text."], subject="L0")
    for level in range(1, 6):
        message = docs.make_email(
            [f"Level {level} text."],
            subject=f"L{level}",
            attachments=[(f"l{level - 1}.eml", bytes(message))],
        )
    path = tmp_path / "deep.eml"
    path.write_bytes(bytes(message))
    text = extract(path, "eml").text
    assert "Level 5 text." in text and "Level 3 text." in text
    assert "Level 2 text." not in text  # two levels of attached files below the top, no more


def test_mbox_every_message(tmp_path):
    path = docs.make_mbox(tmp_path / "inbox.mbox", [[f] for f in FACTS] + [["Third message."]])
    text = extract(path, "mbox").text
    assert all(fact in text for fact in FACTS) and "Third message." in text
    assert text.index("Subject: Message 1") < text.index("Subject: Message 2")


def test_mbox_with_a_damaged_message_keeps_the_others(tmp_path):
    path = docs.make_mbox(tmp_path / "box.mbox", [[FACTS[0]], [FACTS[1]]])
    box = mailbox.mbox(str(path))
    box.add(
        b"Subject: =?broken?Q?x?=\nContent-Type: text/plain; charset=nonsense-42\n\n"
        b"Body in an unknown charset: caf\xe9."
    )
    box.flush()
    box.close()
    text = extract(path, "mbox").text
    assert FACTS[0] in text and FACTS[1] in text and "Body in an unknown charset" in text


@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("junk.eml", bytes(range(256)) * 20, "does not look like"),
        ("plain.eml", b"just some words without any headers at all\n", "no message headers"),
        ("pdf.eml", b"%PDF-1.4\n...", "really a PDF"),
        ("headers-only.eml", b"Subject: \nFrom: \n\n   \n", "no message headers"),
        ("not-a-box.mbox", b"Subject: hi\n\nhello\n", "does not look like a mailbox"),
        ("empty-box.mbox", b"From nobody Mon Jan  1 00:00:00 2024\n\n", "No messages with text"),
    ],
)
def test_broken_mail_files_are_refused_in_words(tmp_path, name, data, reason):
    path = tmp_path / name
    path.write_bytes(data)
    assert reason in refused(path, name.rsplit(".", 1)[1])


def test_an_eml_with_headers_but_no_body_keeps_its_headers(tmp_path):
    path = tmp_path / "note.eml"
    path.write_bytes(b"Subject: Stock count on Friday\nFrom: ops@northwind.example\n\n")
    assert extract(path, "eml").text.startswith("Subject: Stock count on Friday")
    path.write_bytes(b"")
    assert refused(path, "eml") == NO_TEXT
