"""Durable writes on shared filesystems: what survives a crash is what was fsynced.

Invariants:
- `atomic_write` and `atomic_path` leave either the old file or the complete new one under the final
  name, never a mix, and no temporary behind when they fail (a full disk included). The temporary is
  `.{name}.{pid}.tmp` in the same directory: RolloutStore clears a killed writer's `.{name}.*.tmp`.
- `publish_dir` puts a directory written under a temporary name (a checkpoint, a policy export)
  in place whole: readers see the complete directory under its final name or none, and the rename
  is fsynced before it returns.
- An OSError that leaves these helpers names the file it was about (a failed write() carries no
  file name by itself: "No space left on device" alone does not say where).
"""

import contextlib
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data`: a temporary in the same directory, fsynced, renamed."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the complete directory `tmp` to `final` (replacing a leftover there) and fsync the parent."""
    import shutil

    with naming(final):
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_path(Path(final).parent)


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield the temporary path a writer that wants a path (h5py, a raw fd) writes and closes; when
    the block ends normally it is fsynced and renamed onto `path`, on any exception removed. The
    directory is not fsynced: a caller whose rename must survive a crash calls fsync_path on it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with naming(path):
        try:
            yield tmp
            fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def append_line(path: Path, line: str) -> None:
    """Append one line (a JSON record) to a log file; a line cut by a crash is dropped by its readers."""
    with naming(path), open(path, "a") as f:
        f.write(line if line.endswith("\n") else line + "\n")


@contextlib.contextmanager
def naming(path: Path):
    """Re-raise an OSError that names no file as the same error naming `path`."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
