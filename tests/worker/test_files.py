"""worker.files: a file is replaced whole, or not at all."""

from __future__ import annotations

import json

import pytest

from worker.files import write_json_atomic, write_text_atomic


def test_json_is_written_whole_and_replaces_the_old_file(tmp_path):
    path = tmp_path / "deeper" / "result.json"  # the folder is made
    write_json_atomic(path, {"key": "a", "notes": ["déjà vu"]})
    assert json.loads(path.read_text(encoding="utf-8")) == {"key": "a", "notes": ["déjà vu"]}
    assert "déjà" in path.read_text(encoding="utf-8")  # kept as is, not \\u-escaped
    write_json_atomic(path, {"key": "b"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"key": "b"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]  # no temp left


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "doc.txt"
    write_text_atomic(path, "old")
    with pytest.raises(TypeError):
        write_text_atomic(path, None)  # fails while writing the temp file
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["doc.txt"]
