"""_ffi_build's install step: a rebuild must not disturb a server that has the old library mapped,
so a changed file is replaced by rename (a new inode; the old one stays intact for whoever maps it)
and an identical one is not touched at all."""
import importlib.util
import os
import pathlib

SPEC = importlib.util.spec_from_file_location(
    "colibri_ffi_build", pathlib.Path(__file__).resolve().parents[1] / "backend_src" / "colibri" / "_ffi_build.py")


def load_ffi_build():
    module = importlib.util.module_from_spec(SPEC)
    SPEC.loader.exec_module(module)
    return module


def test_install_replaces_by_rename_and_leaves_identical_files_alone(tmp_path):
    install = load_ffi_build().install
    target, new = tmp_path / "libcolibri.so", tmp_path / "new.so"
    target.write_bytes(b"old library")
    with open(target, "rb") as mapped:  # stands for a process that has the old file loaded
        before = os.stat(target)
        new.write_bytes(b"new library, other bytes")
        assert install(new, target) == "libcolibri.so"
        after = os.stat(target)
        assert after.st_ino != before.st_ino and target.read_bytes() == b"new library, other bytes"
        assert mapped.read() == b"old library"  # the old inode is untouched
    assert install(new, target) is None  # same bytes: nothing written
    assert os.stat(target).st_ino == after.st_ino and os.stat(target).st_mtime_ns == after.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libcolibri.so", "new.so"]  # no partial left
