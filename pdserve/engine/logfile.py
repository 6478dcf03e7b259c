"""Append-only JSON-lines logs that never take the service down.

:class:`AppendLog` backs the engine's step log (``--step-log``) and the server's length-pair log
(``--log-length-pairs``). :func:`check_log_path` refuses, at start, a path that cannot be
written (a directory, a missing or read-only folder, a device other than ``/dev/null``, a full
file system), so that ``pdserve serve`` fails with one line before any model loads. At run time
a failed write (a disk that filled up, a file system gone read-only) is logged (the first one,
then every ``LOG_EVERY``-th) and counted in :attr:`AppendLog.errors`, never raised to the caller:
a step or a response does not fail because its log line could not be written. A file rotated
away (deleted or renamed, as logrotate does) is reopened at its path at the next write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)

LOG_EVERY = 1000  # after the first failed write, log every LOG_EVERY-th
MIN_FREE_BYTES = 1 << 20  # a file system with less free space is "full" at start


def check_log_path(path: str | os.PathLike[str], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and ``path`` if a log cannot be appended there."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ValueError(f"{what} {str(path)!r} cannot be used: {e.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{what} {str(path)!r} is a directory")
        if not stat.S_ISREG(st.st_mode) and os.path.realpath(p) != os.devnull:
            raise ValueError(f"{what} {str(path)!r} is not a regular file (a device, a pipe "
                             f"or a socket); give a file path")
        if os.path.realpath(p) == os.devnull:
            return
        if not os.access(p, os.W_OK):
            raise ValueError(f"{what} {str(path)!r} is not writable")
    folder = p.parent if str(p.parent) else Path(".")
    existing = folder
    while not existing.exists():  # the folders that would be created
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(existing)!r} is not a directory")
    if st is None:  # a real file, then removed: os.access says yes to root in /proc
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            raise ValueError(f"{what} {str(path)!r}: the directory {str(existing)!r} is not "
                             f"writable ({e.strerror})") from None
    vfs = os.statvfs(existing)
    free = vfs.f_bavail * vfs.f_frsize
    if free < MIN_FREE_BYTES:
        raise ValueError(f"{what} {str(path)!r}: the file system is full ({free} bytes free)")


class AppendLog:
    """One line-oriented log file, appended to (thread-safe). With ``check`` (the default) the
    constructor raises ``ValueError`` for a path :func:`check_log_path` refuses; without, it
    never raises and a file that cannot be opened counts as failed writes (the engine's step
    log: its path was checked where the deployment started)."""

    def __init__(self, path: str | os.PathLike[str], what: str = "log file",
                 check: bool = True) -> None:
        self.path = Path(path)
        self.what = what
        self.errors = 0  # lines that could not be written
        self.lines = 0  # lines written
        self.reopened = 0  # times the file was reopened after it was rotated away
        self._lock = threading.Lock()
        self._f: TextIO | None = None
        if check:
            check_log_path(self.path, what)
            try:
                self._open()
            except OSError as e:
                raise ValueError(f"cannot write {what} {str(path)!r}: {e.strerror}") from None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")  # noqa: SIM115 - open for the log's life

    def _rotated(self) -> bool:
        """True when the path no longer names the open file (deleted, or renamed and
        replaced)."""
        assert self._f is not None
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        mine = os.fstat(self._f.fileno())
        return (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev)

    def write(self, line: str) -> bool:
        """Append ``line`` (a newline is added) and flush; ``False`` (logged and counted) if it
        could not be written."""
        with self._lock:
            try:
                if self._f is None or self._rotated():
                    if self._f is not None:
                        self._close_quietly()
                        self.reopened += 1
                        log.info("%s %s was rotated away; reopened", self.what, self.path)
                    self._open()
                assert self._f is not None
                self._f.write(line + "\n")
                self._f.flush()
            except (OSError, ValueError) as e:  # ValueError: I/O on a file closed under us
                self.errors += 1
                if self.errors == 1 or self.errors % LOG_EVERY == 0:
                    log.error("cannot write %s %s (%d line(s) lost so far): %s", self.what,
                              self.path, self.errors, e)
                self._close_quietly()  # reopen at the next write: the cause may go away
                return False
            self.lines += 1
            return True

    def _close_quietly(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):  # the buffered rest cannot be flushed: dropped
                f.close()

    @property
    def closed(self) -> bool:
        return self._f is None

    def close(self) -> None:
        with self._lock:
            self._close_quietly()
