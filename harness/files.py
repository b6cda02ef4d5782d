"""Reading a file a user names (a scenario or task file, a layer map): a regular file only, and never more than a
limit. A FIFO would block the read for a writer that never comes, a device like /dev/zero never ends, a directory
is no file: each is refused by name before it is opened (`UnreadableFile`, a ValueError)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnreadableFile(ValueError):
    """A named file that is not a regular file, or is over its read limit; the message names it."""


def read_bounded(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them. FileNotFoundError when it is absent."""
    kind = file_kind(path)
    if kind != "regular file":
        raise UnreadableFile(f"{path}: not a regular file (a {kind}); a {what} is read from a regular file")
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(f"{path}: more than {limit:,} bytes, the most a {what} may have")
    return data


def file_kind(path: str | Path) -> str:
    """"regular file", "directory", "FIFO", "character device", ... of what is at `path` (links followed)."""
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")
