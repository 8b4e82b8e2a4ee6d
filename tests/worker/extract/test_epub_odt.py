"""E-books (EPUB) and OpenDocument text (ODT) on real files (zipfile-built EPUB 3 books,
odfpy-written ODT documents), and on broken, protected and hostile ones."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.fixtures import docs
from worker.extract import ExtractionError, extract

CHAPTERS = [
    ["Northwind Widgets was founded in 1987 in Port Ellery.", "It began with one lathe."],
    ["The NW-4471 Torque Sprocket costs $129.50.", "It weighs 2.3 kg."],
    ["Support is open on extension 4410."],
]


def refused(path: Path, kind: str) -> str:
    with pytest.raises(ExtractionError) as info:
        extract(path, kind)
    return str(info.value)


# --- EPUB ---------------------------------------------------------------------------------


def test_epub_chapters_in_reading_order(tmp_path):
    path = docs.make_epub(tmp_path / "book.epub", CHAPTERS, spine_order=[2, 0, 1])
    text = extract(path, "epub").text
    for chapter in CHAPTERS:
        for paragraph in chapter:
            assert paragraph in text
    # The spine decides the order, not the file names; the table of contents is left out.
    assert text.index("extension 4410") < text.index("founded in 1987") < text.index("$129.50")
    assert "NAV-ONLY-TEXT-5521" not in text
    assert "Chapter 1\n\nNorthwind Widgets was founded" in text


def test_epub_without_a_package_file_is_read_from_its_pages(tmp_path):
    path = docs.make_epub(tmp_path / "book.epub", CHAPTERS)
    broken = tmp_path / "no-opf.epub"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(broken, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith((".opf", "container.xml")):
                dst.writestr(info, src.read(info))
    text = extract(broken, "epub").text
    assert "founded in 1987" in text and "extension 4410" in text


def test_drm_protected_epub_is_refused_in_words(tmp_path):
    path = docs.make_epub(tmp_path / "drm.epub", CHAPTERS, encrypt=True)
    assert "copy-protected (DRM)" in refused(path, "epub")


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        (
            "cut.epub",
            lambda p: p.write_bytes(
                docs.make_epub(p.with_name("w.epub"), CHAPTERS).read_bytes()[:300]
            ),
            "damaged or not really",
        ),
        ("text.epub", lambda p: p.write_text("not a zip at all"), "damaged or not really"),
        (
            "doc.epub",
            lambda p: p.write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(500)),
            "damaged or not really",
        ),
        (
            "empty-zip.epub",
            lambda p: zipfile.ZipFile(p, "w").writestr("mimetype", "x"),
            "No chapters were found",
        ),
    ],
)
def test_broken_epubs_are_refused(tmp_path, name, make, reason):
    path = tmp_path / name
    make(path)
    assert reason in refused(path, "epub")


def test_epub_with_an_entity_bomb_in_its_package_falls_back_safely(tmp_path):
    path = docs.make_epub(tmp_path / "book.epub", CHAPTERS)
    bomb = (
        '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
        '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>'
        '<package xmlns="http://www.idpf.org/2007/opf">&lol2;</package>'
    )
    rewritten = tmp_path / "bomb.epub"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(rewritten, "w") as dst:
        for info in src.infolist():
            data = bomb.encode() if info.filename.endswith(".opf") else src.read(info)
            dst.writestr(info.filename, data)
    text = extract(rewritten, "epub").text  # defusedxml refuses the DTD; pages read by name
    assert "founded in 1987" in text


@pytest.mark.parametrize("kind", ["epub", "odt"])
def test_zip_bombs_are_refused(tmp_path, kind):
    path = (
        docs.make_epub(tmp_path / "b.epub", CHAPTERS)
        if kind == "epub"
        else docs.make_odt(tmp_path / "b.odt", ["An innocent looking document."])
    )
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("filler.bin", bytes(1024))
        zf.filelist[-1].file_size = 600 * 2**20  # what the central directory claims
    assert "far more than a normal document" in refused(path, kind)


# --- ODT ----------------------------------------------------------------------------------


def test_odt_heading_paragraphs_list_and_table(tmp_path):
    path = docs.make_odt(
        tmp_path / "sheet.odt",
        ["The Quiet Hinge has a lifetime warranty."],
        heading="Product sheet",
        bullets=["Ships in 2 days", "Free returns for 30 days"],
        table=[["Product", "Price"], ["Gale Fan Mk III", "$89.00"]],
    )
    text = extract(path, "odt").text
    assert text == (
        "Product sheet\n\nThe Quiet Hinge has a lifetime warranty.\n\n"
        "Ships in 2 days\n\nFree returns for 30 days\n\n"
        "Product | Price\nGale Fan Mk III | $89.00"
    )


def test_odt_without_text_says_so(tmp_path):
    path = docs.make_odt(tmp_path / "blank.odt", ["", "  "])
    assert refused(path, "odt") == "No text found in this document."


def test_password_protected_odt_is_refused_in_words(tmp_path):
    path = docs.make_odt(tmp_path / "a.odt", ["Secret plans."])
    locked = tmp_path / "locked.odt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(locked, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "META-INF/manifest.xml":
                data = data.replace(
                    b'manifest:full-path="content.xml"',
                    b'manifest:full-path="content.xml"><manifest:encryption-data/'
                    b'></manifest:file-entry><manifest:file-entry manifest:media-type="" '
                    b'manifest:full-path="x"',
                )
            elif info.filename == "content.xml":
                data = bytes(range(256)) * 8  # encrypted bytes look like this
            dst.writestr(info.filename, data)
    assert "password-protected" in refused(locked, "odt")


@pytest.mark.parametrize(
    ("name", "make"),
    [
        (
            "cut.odt",
            lambda p: p.write_bytes(
                docs.make_odt(p.with_name("w.odt"), ["Cut short."]).read_bytes()[:400]
            ),
        ),
        ("doc.odt", lambda p: p.write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(500))),
        ("nocontent.odt", lambda p: zipfile.ZipFile(p, "w").writestr("mimetype", "x")),
        ("badxml.odt", lambda p: zipfile.ZipFile(p, "w").writestr("content.xml", "<office:")),
    ],
)
def test_broken_odt_files_are_refused(tmp_path, name, make):
    path = tmp_path / name
    make(path)
    assert "damaged or not really an OpenDocument text" in refused(path, "odt")
