"""``PD_CACHE_DIR/kernels`` (``pd.core.cpp``): a compiled library pd loads is code run in its
process, so the directory is made 0700, and a cache directory, kernels directory or library that
another user could write is refused with the path and its mode. Real directories and a real
compiler (a one-line library, built in a fraction of a second)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from pd.core import cpp

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler"),
]
_SOURCE = 'extern "C" int one() { return 1; }'


def _build(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Path | None:
    monkeypatch.setenv("PD_CACHE_DIR", str(cache))
    return cpp._build("one", _SOURCE, ("-shared", "-fPIC"))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_kernels_are_built_into_a_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = _build(monkeypatch, tmp_path / "cache")
    assert lib is not None and lib.parent == tmp_path / "cache" / "kernels"
    assert _mode(lib.parent) == 0o700 and _mode(tmp_path / "cache") & 0o022 == 0
    lib.parent.chmod(0o755)  # an older pd's: tightened
    assert _build(monkeypatch, tmp_path / "cache") == lib and _mode(lib.parent) == 0o700


@pytest.mark.parametrize("where", ["cache dir", "kernels dir", "library"])
def test_a_kernel_cache_another_user_could_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    cache = tmp_path / "cache"
    lib = _build(monkeypatch, cache)
    assert lib is not None
    target = {"cache dir": cache, "kernels dir": lib.parent, "library": lib}[where]
    target.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"{target} .*0777.* writable by group"):
        _build(monkeypatch, cache)
    target.chmod(0o700)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(target, 65534, 65534)
        with pytest.raises(PermissionError, match=rf"{target} \(owner uid 65534"):
            _build(monkeypatch, cache)
