"""The C build helper: a library is built once and reused, a compiler error is an OSError,
and the build folder must be the user's own."""

from __future__ import annotations

import os
import shutil

import pytest

from kvtier.kernels import native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@pytest.fixture()
def temp_root(tmp_path, monkeypatch):
    """The system temp dir moved under the test's own folder."""
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_a_library_is_built_once_and_loaded_from_the_private_folder(temp_root):
    lib = native.build_library("demo", "int twice(int x) { return 2 * x; }")
    assert lib.twice(21) == 42
    folder = temp_root / f"kvtier-kernels-{os.getuid()}"
    built = list(folder.glob("demo-*.so"))
    assert len(built) == 1 and folder.stat().st_mode & 0o777 == 0o700
    stamp = built[0].stat().st_mtime_ns
    assert native.build_library("demo", "int twice(int x) { return 2 * x; }").twice(4) == 8
    assert built[0].stat().st_mtime_ns == stamp  # the same source is not compiled again
    native.build_library("demo", "int twice(int x) { return x + x; }")  # another source: another file
    assert len(list(folder.glob("demo-*.so"))) == 2


def test_a_compiler_error_is_an_oserror_and_leaves_nothing_behind(temp_root):
    with pytest.raises(OSError, match="failed"):
        native.build_library("broken", "int f( { return; }")
    assert not list((temp_root / f"kvtier-kernels-{os.getuid()}").glob("broken-*"))


def test_a_folder_others_can_write_is_refused(temp_root):
    folder = temp_root / f"kvtier-kernels-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(OSError, match="writable by others; remove it"):
        native.build_library("demo", "int one(void) { return 1; }")


def test_load_or_warn_says_why_and_what_happens_instead(temp_root):
    with pytest.warns(UserWarning, match=r"(?s)broken CPU kernels unavailable \(.*failed.*\); the reference serves"):
        assert native.load_or_warn("broken", "int f( {", lambda lib: lib, "the reference serves") is None
    assert native.load_or_warn("demo", "int three(void) { return 3; }", lambda lib: lib.three(), "x") == 3
