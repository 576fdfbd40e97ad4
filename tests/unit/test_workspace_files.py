"""A workspace's manifest (exclusions, limits) and a host's copy of it (writes, removals, refusals)."""

from __future__ import annotations

import hashlib
import os

import pytest

from monarch_nb.runtime.workspace_files import (FileEntry, WorkspaceCopy, WorkspaceError, WorkspaceTooLarge, read_current,
                                             safe_relative, scan)


def _write(root, rel: str, data: bytes = b"x = 1\n") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _entry(data: bytes, mode: int = 0o644) -> FileEntry:
    return FileEntry(hashlib.sha256(data).hexdigest(), len(data), mode)


def test_the_manifest_holds_code_and_data_but_not_what_git_or_the_defaults_ignore(tmp_path):
    for rel in ("train.py", "pkg/__init__.py", "pkg/model.py", "configs/base.yaml", "data/small.csv",
                "pkg/__pycache__/model.cpython-311.pyc", ".git/HEAD", ".venv/bin/python", ".ipynb_checkpoints/a.ipynb",
                "runs/1/log.txt", "pkg/scratch.tmp", "pkg/keep.tmp", "notes.log"):
        _write(tmp_path, rel)
    (tmp_path / ".gitignore").write_text("# runs and logs\nruns/\n*.log\n")
    (tmp_path / "pkg" / ".gitignore").write_text("*.tmp\n!keep.tmp\n")
    os.chmod(tmp_path / "train.py", 0o755)
    manifest = scan(str(tmp_path), exclude=["data/*.csv"])
    assert sorted(manifest.files) == [".gitignore", "configs/base.yaml", "pkg/.gitignore", "pkg/__init__.py",
                                      "pkg/keep.tmp", "pkg/model.py", "train.py"]
    assert manifest.files["train.py"] == _entry(b"x = 1\n", 0o755)
    assert read_current(manifest, ["pkg/model.py"])[2] == [b"x = 1\n"]


def test_a_folder_over_the_limit_is_refused_with_its_largest_files_and_the_fix(tmp_path):
    _write(tmp_path, "model.pt", b"\0" * 3000)
    _write(tmp_path, "a.py")
    with pytest.raises(WorkspaceTooLarge, match=r"the largest: model\.pt .* Exclude them .*max_bytes"):
        scan(str(tmp_path), max_bytes=2000)
    assert sorted(scan(str(tmp_path), exclude=["*.pt"], max_bytes=2000).files) == ["a.py"]
    with pytest.raises(WorkspaceTooLarge, match="more than 1 files"):
        scan(str(tmp_path), max_files=1)
    with pytest.raises(NotADirectoryError, match="no folder"):
        scan(str(tmp_path / "nope"))


def test_a_copy_writes_what_changed_keeps_the_rest_removes_what_went_and_names_what_it_lacks(tmp_path):
    copy = WorkspaceCopy(str(tmp_path / "copy"))
    a, b = b"A = 1\n", b"B = 1\n"
    first = copy.apply({"a.py": _entry(a), "pkg/b.py": _entry(b)}, {"a.py": a, "pkg/b.py": b})
    assert first.written == ("a.py", "pkg/b.py") and first.bytes == len(a) + len(b) and not first.missing
    cache = tmp_path / "copy" / "pkg" / "__pycache__"
    cache.mkdir()
    (cache / "b.cpython-311.pyc").write_bytes(b"stale")
    b2 = b"B = 2\n"  # same size: only the hash tells it changed
    second = copy.apply({"a.py": _entry(a), "pkg/b.py": _entry(b2), "c.py": _entry(b"C\n")}, {"pkg/b.py": b2})
    assert second.written == ("pkg/b.py",) and second.missing == ("c.py",) and not second.removed
    assert (tmp_path / "copy" / "pkg" / "b.py").read_bytes() == b2
    assert not (cache / "b.cpython-311.pyc").exists(), "a changed module's compiled cache must go"
    third = copy.apply({"a.py": _entry(a)}, {})
    assert third.removed == ("pkg/b.py",) and not third.written
    assert not (tmp_path / "copy" / "pkg").exists(), "a folder left with nothing but caches is removed"
    assert sorted(os.listdir(tmp_path / "copy")) == ["a.py"]


def test_a_copy_refuses_paths_out_of_its_folder_and_damaged_files_and_writes_nothing(tmp_path):
    copy = WorkspaceCopy(str(tmp_path / "copy"))
    data = b"x"
    for rel in ("../evil.py", "/etc/passwd", "a/../../b", "a\\b", "", "a//b", "./a"):
        with pytest.raises(ValueError, match="refused workspace path"):
            copy.apply({rel: _entry(data), "ok.py": _entry(data)}, {"ok.py": data})
    with pytest.raises(ValueError, match="arrived damaged"):
        copy.apply({"ok.py": _entry(data), "bad.py": _entry(b"y")}, {"ok.py": data, "bad.py": b"z"})
    with pytest.raises(ValueError, match="not in the manifest"):
        copy.apply({}, {"stray.py": data})
    assert os.listdir(tmp_path / "copy") == [] and copy.files == {}
    assert not (tmp_path / "evil.py").exists()
    assert safe_relative("pkg/mod.py") == "pkg/mod.py"


def test_as_in_git_the_deepest_gitignore_rule_decides_and_bad_lines_are_skipped(tmp_path):
    for rel in ("a.log", "sub/keep.log", "sub/deep/keep.log", "sub/other.log", "pkg/env/x.py", "env/activate"):
        _write(tmp_path, rel)
    (tmp_path / ".gitignore").write_text("*.log\n[z-a]\n!\n")  # git skips the two lines it cannot take
    (tmp_path / "sub" / ".gitignore").write_text("!keep.log\n")
    assert sorted(scan(str(tmp_path)).files) == [".gitignore", "pkg/env/x.py", "sub/.gitignore", "sub/deep/keep.log",
                                                 "sub/keep.log"], "only a top-level env/ is an environment"
    with pytest.raises(WorkspaceError, match=r"bad pattern '\[z-a\]' in exclude"):
        scan(str(tmp_path), exclude=["[z-a]"])


def test_names_no_host_can_take_are_refused_at_the_scan_and_limits_come_before_hashing(tmp_path, monkeypatch):
    _write(tmp_path, "a\\b.txt")
    with pytest.raises(WorkspaceError, match=r"cannot sync 'a\\\\b.txt'.*rename it or exclude it"):
        scan(str(tmp_path))
    assert sorted(scan(str(tmp_path), exclude=["*.txt"]).files) == []
    with open(tmp_path / "huge.bin", "wb") as f:
        f.truncate(2**31)  # sparse: 2 GiB that nothing should read
    import monarch_nb.runtime.workspace_files as wf

    monkeypatch.setattr(wf, "_entry", lambda path: pytest.fail(f"hashed {path} before checking the limit"))
    with pytest.raises(WorkspaceTooLarge, match=r"holds 2\.0 GiB to sync, over the 64\.0 MiB limit; the largest: huge\.bin"):
        scan(str(tmp_path), exclude=["*.txt"])


def test_a_file_written_or_removed_after_the_scan_is_sent_as_it_is_then(tmp_path):
    _write(tmp_path, "hot.txt", b"one")
    _write(tmp_path, "doomed.txt", b"bye")
    manifest = scan(str(tmp_path))
    (tmp_path / "hot.txt").write_bytes(b"two!")
    os.remove(tmp_path / "doomed.txt")
    current, sent, contents = read_current(manifest, ["doomed.txt", "hot.txt"])
    assert sent == ["hot.txt"] and contents == [b"two!"] and sorted(current.files) == ["hot.txt"]
    assert current.files["hot.txt"] == _entry(b"two!")
    copy = WorkspaceCopy(str(tmp_path / "copy"))
    assert copy.apply(current.files, dict(zip(sent, contents))).written == ("hot.txt",)


def test_a_path_that_turns_from_a_file_into_a_folder_and_back_syncs(tmp_path):
    copy = WorkspaceCopy(str(tmp_path / "copy"))
    copy.apply({"data": _entry(b"f")}, {"data": b"f"})
    assert copy.apply({"data/x.csv": _entry(b"1,2")}, {"data/x.csv": b"1,2"}).removed == ("data",)
    assert (tmp_path / "copy" / "data" / "x.csv").read_bytes() == b"1,2"
    assert copy.apply({"data": _entry(b"g")}, {"data": b"g"}).written == ("data",)
    assert (tmp_path / "copy" / "data").read_bytes() == b"g"
