"""Writing output files without losing anything: every writer of mxmoe (artifacts, ``mxmoe run --output``,
safetensors checkpoints) goes through :func:`write_atomically`. numpy-free, torch-free.

The destination is checked before any work (:func:`output_path`), so a long compile does not end in "permission
denied"; the bytes go to a temporary file beside it, which is synced and renamed into place, so a reader never
sees half a file and an old file stays whole until the new one is complete; the temporary is removed on every
failure. A symlink is followed on purpose: its target is replaced and the link stays a link (as ``cp`` and shell
redirection do). A path that holds anything but a regular file (a directory, a device, a FIFO, a socket) is
refused rather than replaced.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

#: errno -> what a full or limited disk is called in an error line
_NO_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file too large (a file size limit)"}


class OutputError(OSError):
    """An output file cannot be written where asked; the message is one line naming the path and the cause."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def output_path(path: str | os.PathLike) -> Path:
    """The regular file that writing ``path`` will replace (a symlink's target), checked now: OutputError unless
    it is absent or a regular file and its folder exists and is writable."""
    p = Path(path)
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:  # a symlink loop, a path through a file...
        raise OutputError(f"{p}: cannot write there ({e.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{p}: is a directory; give the path of the file to write")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{p}: is a {_kind(st.st_mode)}, not a regular file; refusing to replace it")
    folder = target.parent
    if not folder.is_dir():
        raise OutputError(f"{folder}: output directory does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{folder}: output directory is not writable")
    return target


def output_error(e: OSError, path: str | os.PathLike) -> OSError:
    """``e`` as one line naming ``path`` when it means the disk is full or a size limit was hit, else ``e``."""
    if isinstance(e, OutputError) or e.errno not in _NO_ROOM:
        return e
    return OutputError(f"{_NO_ROOM[e.errno]} writing {path}")


@contextmanager
def write_atomically(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` only when the block ends without an
    error, and is removed otherwise. A full disk becomes ``OutputError("no space left on device writing PATH")``."""
    target = output_path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    except OSError as e:
        raise OutputError(f"{path}: cannot create a file in {target.parent} ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; give it the usual permissions
        os.replace(tmp, target)
    except OSError as e:
        _remove(tmp)
        err = output_error(e, path)
        if err is e:
            raise
        raise err from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
