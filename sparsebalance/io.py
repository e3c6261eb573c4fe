"""Atomic file writes: the whole file appears at its path, or nothing does.

Every writer of the project (profiles, summaries, reports, figures, traces,
checkpoint manifests) goes through :func:`atomic_path`: the data is written to a
temporary file in the destination's directory, flushed to disk, then renamed
over the destination with ``os.replace`` (atomic on POSIX within one file
system). A crash, a full disk or an exception mid-write leaves the old file (or
no file) and no temporary behind. A full disk is reported as ``OSError`` with
errno ``ENOSPC`` whose message names the path, not as whatever the serializer
happened to say.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path``.

    For writers that take a file name (``savefig``, ``torch.save``, ``np.save``).
    ``suffix`` is kept on the temporary name for writers that infer the format
    from it (``.png``). The file gets the permissions a plain ``open`` would give.
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", suffix=suffix, dir=d)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the file from others
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quietly(tmp)
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on device (ENOSPC) writing {path}") from None
        raise
    except BaseException:
        _unlink_quietly(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
