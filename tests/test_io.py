"""grpo_npu.io: atomic file and directory writes, JSON lines with a torn tail."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from grpo_npu import io as gio


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_atomic_replaces_content_with_the_usual_mode(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    assert gio.write_atomic(path, "new ü") == path
    assert path.read_bytes() == "new ü".encode("utf-8")
    assert gio.write_atomic(path, b"\x00bytes") == path and path.read_bytes() == b"\x00bytes"
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]  # no temp file left


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with gio.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_missing_folder_is_one_line_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"folder {tmp_path / 'no'} does not exist"):
        gio.write_atomic(tmp_path / "no" / "a.txt", b"x")


def test_write_json_is_json_dumps(tmp_path):
    obj = {"b": [1, 2], "a": {"c": None}}
    gio.write_json(tmp_path / "x.json", obj, indent=2, sort_keys=True)
    assert (tmp_path / "x.json").read_text() == json.dumps(obj, indent=2, sort_keys=True)


def _make(folder, text: str):
    folder.mkdir()
    (folder / "f").write_text(text)
    return folder


def test_commit_dir_moves_the_old_directory_aside(tmp_path):
    final = tmp_path / "final"
    assert gio.commit_dir(_make(tmp_path / "tmp", "v1"), final) is None
    assert (final / "f").read_text() == "v1" and not (tmp_path / "tmp").exists()
    old = gio.commit_dir(_make(tmp_path / "tmp", "v2"), final, trash=tmp_path / "trash")
    assert old == tmp_path / "trash" and (old / "f").read_text() == "v1"
    assert (final / "f").read_text() == "v2"
    # A leftover at the trash name (an attempt killed before deleting it) is replaced.
    assert (gio.commit_dir(_make(tmp_path / "tmp", "v3"), final, trash=old) / "f").read_text() == "v2"


def test_jsonl_appender_appends_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "x"')  # a writer killed mid-line
    out = gio.JsonlAppender(path)
    out.append({"step": 2, "x": 1.5})
    out.close()
    out.close()  # idempotent
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1}, {"step": 2, "x": 1.5}]


def test_written_files_and_committed_folders_follow_the_umask(tmp_path, tiny_model_path):
    """A team sharing data and run directories sets its umask; mkstemp/mkdtemp (0600/0700) must not override it."""
    import stat

    from grpo_npu.data.parquet import write_parquet_atomic
    from grpo_npu.models.tiny import build_tiny_model

    old = os.umask(0o002)
    try:
        parquet = write_parquet_atomic([{"a": 1}], tmp_path / "d.parquet")
        kit = build_tiny_model(tmp_path / "cache")
    finally:
        os.umask(old)
    assert stat.S_IMODE(parquet.stat().st_mode) == 0o664
    assert stat.S_IMODE(Path(kit).stat().st_mode) == 0o775
