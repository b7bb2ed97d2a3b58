"""Directories and files whose contents pd trusts: a compiled kernel it loads (``pd.core.cpp``),
the disk tier's KV chunks and key (``pd.cache.disk_dir``).

The threat is another user of the machine writing into them: a ``.so`` another user can write
is code execution in pd's process; a KV chunk is what a request's answer is computed from.
So such a directory is created 0700 and an existing one (or file) is used only if it is owned
by this user (or root, who can do anything anyway) and writable by neither group nor others;
anything else is refused with ``InsecurePathError``, naming the path, its owner and its mode.
Its parents matter as much (``check_parents``, as ssh's StrictModes): whoever can write a parent
can rename the directory away and put their own in its place. A parent must be owned by this
user or root and writable by neither group nor others, unless it is sticky and root's or this
user's (``/tmp``: others may add names there but not rename or remove this user's).
The same user is not defended against: it can read and write whatever this process can.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class InsecurePathError(PermissionError):
    """A path pd would trust that another user could write (or that is not what it must be)."""


def _describe(path: Path, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} = {st.st_mode & 0o7777:04o})"


def check_trusted(path: Path, st: os.stat_result, *, is_dir: bool) -> None:
    """Raise ``InsecurePathError`` unless ``st`` (``path``'s lstat) is a directory (or a
    regular file) owned by this user or root and not writable by group or others."""
    uid = os.geteuid()
    kind = stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)
    if not kind:
        what = "a directory" if is_dir else "a regular file"
        raise InsecurePathError(f"{_describe(path, st)} is not {what} (a symlink is refused)")
    if st.st_uid not in (uid, 0):
        raise InsecurePathError(
            f"{_describe(path, st)} is owned by another user (this process runs as uid {uid}): "
            "refused, since its contents would be trusted; use a directory of your own"
        )
    if st.st_mode & 0o022:
        raise InsecurePathError(
            f"{_describe(path, st)} is writable by group or others: refused, since its "
            f"contents would be trusted; chmod go-w {path} (or use a directory of your own)"
        )


def check_parents(path: Path) -> None:
    """Raise ``InsecurePathError`` unless every existing directory above ``path`` (as written,
    each followed through its symlinks, and as resolved) is owned by this user or root and
    writable by neither group nor others, or is sticky and owned by this user or root."""
    path = Path(os.path.abspath(path))
    seen: set[Path] = set()
    for chain in (path.parents, Path(os.path.realpath(path)).parents):
        for parent in chain:
            if parent in seen:
                continue
            seen.add(parent)
            try:
                st = os.stat(parent)
            except FileNotFoundError:  # made later, with this user's umask: checked then
                continue
            uid = os.geteuid()
            if st.st_uid not in (uid, 0):
                raise InsecurePathError(
                    f"{_describe(parent, st)}, a parent of {path}, is owned by another user "
                    f"(this process runs as uid {uid}): refused, since it could replace "
                    f"{path.name}; use a directory under one of your own"
                )
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                raise InsecurePathError(
                    f"{_describe(parent, st)}, a parent of {path}, is writable by group or "
                    f"others (and not sticky): refused, since they could replace {path.name}; "
                    f"chmod go-w {parent} (or use a directory under one of your own)"
                )


def private_dir(path: Path, *, tighten: bool = True) -> Path:
    """``path`` as a directory that only this user can write: created 0700 (its missing
    parents with the default mode) if absent; an existing one is checked (``check_trusted``)
    and, with ``tighten``, made 0700 if this user owns it and group or others may read it."""
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another process: checked below
            pass
    st = os.lstat(path)
    check_trusted(path, st, is_dir=True)
    if tighten and st.st_uid == os.geteuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path
