"""ajet's error types. Each message says what is wrong and what to change."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path


class AjetError(Exception):
    """Base class: the CLI prints these without a traceback and exits with status 2."""


class ConfigError(AjetError, ValueError):
    """The config file is missing, unreadable, or has an unknown key / wrong type / bad value."""


class BackboneUnavailable(AjetError, ImportError):
    """The chosen backbone's optional dependencies are not installed (the message names the extra)."""


class WorkflowLoadError(AjetError, ImportError):
    """The `workflow:` or `judge:` entry does not name an importable object."""


class DiskFull(AjetError, OSError):
    """A file ajet had to write (a checkpoint) did not fit on its disk; the message says where, how much is free and
    what to do."""


# how a full disk reads in the errors of what ajet writes with: the OS (errno), safetensors ("StorageFull"), SQLite
# (SQLITE_FULL: the trajectory store) and Ray's object store, which spills to disk (`OutOfDiskError`: verl's weight
# export)
_DISK_FULL_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded", "Local disk is full",
                   "database or disk is full")


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then the exception it was raised from (`__cause__`, else `__context__`), and so on, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def first_line(exc: BaseException) -> str:
    """The first non-blank line of `exc`'s message, stripped; its class name when the message is blank."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says a disk is full: an OSError with errno ENOSPC or
    EDQUOT, Ray's `OutOfDiskError` (by class name: no Ray import), or one of the messages above."""
    return any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
               or any(c.__name__ == "OutOfDiskError" for c in type(e).__mro__)
               or any(text in str(e) for text in _DISK_FULL_TEXT) for e in exception_chain(exc))


def disk_free(path: Path) -> str:
    """"X free of Y" for the disk that holds `path` (MB below 1 GB, else GB)."""
    usage = shutil.disk_usage(path)
    size = lambda n: f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"   # noqa: E731
    return f"{size(usage.free)} free of {size(usage.total)}"
