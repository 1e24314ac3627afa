"""A local (or network-mounted) directory as an object store: the embedded default.

Writes go to a temporary file in the same directory and are published with
``os.replace``, so a reader never sees a partial object and a crash leaves at
most a stray temporary file. With ``fsync`` (the default) a write is durable when
``put`` returns: the file is synced before its rename, its folder (and the parent of
any folder made for it) after, so a commit marker never survives a power loss that
its manifest or pieces do not. Conditional writes take an ``flock`` on one lock
file per store, held only for the rename. The generation is the file's
``st_mtime_ns``, forced to increase under that lock. A store bounded by a
deadline (:meth:`LocalStore.within`) waits for that lock no longer than the
deadline allows; the disk itself is not bounded.

Several processes (two gcs, a gc and a save) may list, stat, sweep and delete in one
directory at once: a file or folder another one removed meanwhile is simply gone, never an
error. Ages (the sweep's) are measured on the file system's own clock: the mtime of a probe
file written in the root, as the files themselves get theirs (a network mount's server).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Iterator, Sequence

import tenacity

from ckpt_service.deadline import Deadline
from ckpt_service.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreDeadlineError,
    StoreListingError,
    StoreUnavailableError,
)
from ckpt_service.stores.base import ObjectInfo, ObjectStore, check_key

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".hvdt.lock"
#: how often a bounded store tries the lock again while another writer holds it (it is held
#: only for a rename, so it frees within milliseconds unless that writer is stuck)
_LOCK_POLL_MAX_S = 0.05
#: the most buffers one preadv takes
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, deadline: Deadline | None = None) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.fsync = fsync
        self.deadline = deadline
        _check_root(self.root)

    def within(self, deadline: Deadline) -> LocalStore:
        """The same directory, waiting for the store lock no longer than ``deadline`` allows."""
        return type(self)(self.root, fsync=self.fsync, deadline=deadline)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.root}/{key} does not exist") from None

    def get_into(self, key: str, buffer: memoryview) -> tuple[int, bytes] | None:
        """Read the object's first ``len(buffer)`` bytes into ``buffer`` (no intermediate copy):
        (bytes read, the rest of the object), or None if it does not exist."""
        try:
            with open(self._path(key), "rb", buffering=0) as fh:
                n = 0
                while n < len(buffer) and (got := fh.readinto(buffer[n:])):
                    n += got
                return n, fh.readall()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get_into_parts(self, key: str, buffers: Sequence[memoryview]) -> tuple[int, int] | None:
        """Scatter-read the object's first bytes into ``buffers``, in order, with no intermediate
        copy (``preadv``): (bytes read, the object's size), or None if it does not exist. Nothing
        is read from an object whose size is not the buffers' total (the caller reports it)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size, want = os.fstat(fd).st_size, sum(len(b) for b in buffers)
            if size != want:
                return 0, size
            return _preadv_all(fd, buffers), size
        finally:
            os.close(fd)

    def get_versioned(self, key: str) -> tuple[bytes, int] | None:
        # An open file keeps the inode it opened, even if os.replace publishes another one:
        # its bytes and its fstat mtime (the generation) belong together.
        try:
            with open(self._path(key), "rb") as fh:
                return fh.read(), os.fstat(fh.fileno()).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            return None

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime_ns, st.st_mtime)

    @contextlib.contextmanager
    def _store_lock(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / _LOCK_NAME, "a+b") as fh:
            if self.deadline is None:
                fcntl.flock(fh, fcntl.LOCK_EX)
            else:
                _lock_by(fh, self.deadline, self.root)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _write_tmp(self, path: Path, data: Sequence[bytes | memoryview]) -> tuple[Path, set[Path]]:
        """Write ``data`` to a durable temp file beside ``path``: (its path, the folders whose
        entries must be synced once it is renamed into place)."""
        tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
        to_sync = {path.parent}
        for attempt in range(3):
            try:
                to_sync |= {made.parent for made in _make_dirs(path.parent)}
                fh = open(tmp, "wb")
                break
            except FileNotFoundError:
                # A concurrent sweep removed an empty folder on this path between the mkdir and
                # the open (or inside mkdir's own walk down the parents): make it again.
                if attempt == 2:
                    raise
            except PermissionError as exc:
                raise StoreUnavailableError(f"cannot write in {path.parent}: {exc}; check the store path") from exc
        with fh:
            for part in data:
                fh.write(part)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        return tmp, to_sync

    def put(self, key: str, data: bytes, *, if_generation_match: int | None = None) -> int:
        return self.put_parts(key, (data,), if_generation_match=if_generation_match)

    def put_parts(self, key: str, parts: Sequence[bytes | memoryview], *,
                  if_generation_match: int | None = None) -> int:
        """:meth:`put` of the concatenation of ``parts``, written without joining them."""
        path = self._path(key)
        tmp, folders = self._write_tmp(path, parts)
        try:
            # Every write, conditional or not, publishes under the lock with a strictly
            # larger generation, so a stale compare-and-swap can never succeed.
            with self._store_lock():
                info = self.stat(key)
                have = 0 if info is None else info.generation
                if if_generation_match is not None and have != if_generation_match:
                    raise PreconditionFailedError(
                        f"{path}: generation is {have}, expected {if_generation_match}"
                    )
                new_gen = self._stamp_after(tmp, have)
                os.replace(tmp, path)
            if self.fsync:
                # Durable once put returns, every object: a commit marker must never outlive the
                # manifest or pieces it names. The rename and any folder made for it are entries
                # of folders, which only a sync of those folders makes survive a power loss.
                for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
                    _fsync_dir(folder)
            return new_gen
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _stamp_after(self, tmp: Path, have: int) -> int:
        """Give ``tmp`` an mtime (its generation once published) above ``have`` and above every generation
        given in this store before, on any filesystem; called under the store lock.

        Generations must strictly increase even within one clock tick, and on a filesystem that
        keeps coarse timestamps (1 s on ext2/3 and HFS+, 2 s on FAT) "+1 ns" is truncated away and a
        stale compare-and-swap would match the newer write: so the next whole seconds are tried
        until the stored mtime is larger. A key deleted and created again must not get a generation
        it had before either, so every generation is also above the last one given in the store,
        kept as the mtime of the lock file (the writers' own clocks may disagree by any amount).
        """
        lock = self.root / _LOCK_NAME
        floor = max(have, os.stat(lock).st_mtime_ns)
        wanted = max(os.stat(tmp).st_mtime_ns, floor + 1)
        tick = 10**9
        for candidate in (wanted, (floor // tick + 1) * tick, (floor // tick + 2) * tick,
                          (floor // tick + 3) * tick):
            stamped = self._set_mtime(tmp, candidate)
            if stamped > floor:
                os.utime(lock, ns=(stamped, stamped))
                return stamped
        raise StoreUnavailableError(f"{self.root}: the filesystem does not keep file times that move forward; "
                                    "use a filesystem with ordinary timestamps for the store")

    def _set_mtime(self, path: Path, ns: int) -> int:
        """Set ``path``'s mtime to ``ns``; the mtime the filesystem kept (it may round it)."""
        os.utime(path, ns=(ns, ns))
        return os.stat(path).st_mtime_ns

    def delete_if_generation(self, key: str, generation: int) -> bool:
        path = self._path(key)
        with self._store_lock():  # every write publishes under it: nothing moves it meanwhile
            info = self.stat(key)
            if info is None or info.generation != generation:
                return False
            path.unlink()
        self._tidy(path)  # outside the lock, and never the key itself: it may have been created again since
        return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            path.unlink()
        self._tidy(path)

    def _tidy(self, path: Path) -> None:
        """Remove the now-empty folders above ``path`` up to the root (best effort)."""
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list(self, prefix: str = "") -> Iterator[str]:
        if "/" in prefix:
            check_key(prefix.rsplit("/", 1)[0])  # a prefix must not climb out of the root either
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return
        keys: list[str] = []

        def failed(exc: OSError) -> None:
            if isinstance(exc, FileNotFoundError):
                return  # a folder removed since it was seen (a delete tidying up): nothing to list there
            raise StoreListingError(f"listing {self.root}/{prefix} failed at {exc.filename}: {exc}; the store's "
                                    "contents are unknown, so nothing is taken for absent (check the folder's "
                                    "permissions or the mount, then try again)") from exc

        for dirpath, _dirs, files in os.walk(base, onerror=failed):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in files:
                if name.startswith(_TMP_PREFIX) or name == _LOCK_NAME:
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        yield from sorted(keys)

    def store_time(self) -> float:
        """The mtime of a probe file just written in the root: the clock the files' mtimes come from."""
        if not self.root.is_dir():
            return time.time()  # nothing stored yet, so nothing to age
        try:
            fd, name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}clock.", dir=self.root)
        except FileNotFoundError:
            return time.time()  # the root went meanwhile
        except PermissionError as exc:
            raise StoreUnavailableError(f"cannot write in {self.root}: {exc}; check the store path") from exc
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def sweep_temporary(self, older_than_s: float, *, now: float | None = None) -> int:
        """Delete temp files (a write killed before its rename) and then-empty folders older than
        ``older_than_s`` by the store's clock (``now`` overrides it); younger ones may belong to a
        write in progress. What another sweep removes meanwhile is skipped."""
        if not self.root.is_dir():
            return 0
        cutoff = (self.store_time() if now is None else now) - older_than_s
        removed = 0
        emptied: set[Path] = set()  # folders this sweep took something from (their mtime is now)
        for dirpath, _dirs, files in os.walk(self.root, topdown=False):
            here = Path(dirpath)
            for name in files:
                path = here / name
                if name.startswith(_TMP_PREFIX) and _mtime(path) < cutoff:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        removed += 1
                        emptied.add(here)
            # an empty folder may be one a writer just made for its next file: only old ones go
            if here != self.root and _is_empty(here) and (here in emptied or _mtime(here) < cutoff):
                with contextlib.suppress(OSError):
                    here.rmdir()
                    emptied.add(here.parent)
        if removed:
            log.info("removed %d stale temp files from %s", removed, self.root)
        return removed


def _check_root(root: Path) -> None:
    """StoreUnavailableError unless ``root`` is a directory or can be made one: a file at it, or at
    any folder above it, would fail every write (NotADirectoryError) and read as an empty store."""
    for folder in (root, *root.parents):
        try:
            is_dir = stat.S_ISDIR(folder.stat().st_mode)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: the first write makes it
        except OSError:
            return  # unreadable here (permissions): the calls that use it report that
        if is_dir:
            return
        if folder == root:
            raise StoreUnavailableError(f"{root} exists and is not a directory; pick another path")
        raise StoreUnavailableError(
            f"{root} cannot be a store directory: {folder} above it is a file, not a directory; pick another path")


def _preadv_all(fd: int, buffers: Sequence[memoryview]) -> int:
    """``os.preadv`` from offset 0 until ``buffers`` are full or the file ends: bytes read."""
    done, views = 0, [b for b in buffers if len(b)]
    while views:
        got = os.preadv(fd, views[:_IOV_MAX], done)
        if not got:
            break
        done += got
        while views and got >= len(views[0]):  # drop the buffers now full, cut the one begun
            got -= len(views.pop(0))
        if got:
            views[0] = views[0][got:]
    return done


def _lock_by(fh: IO[bytes], deadline: Deadline, root: Path) -> None:
    """Take the store lock, giving up with StoreDeadlineError at the deadline's end."""
    end = time.monotonic() + deadline.left(time.time())  # the epoch deadline, on the interval clock
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(BlockingIOError),
        wait=lambda state: min(tenacity.wait_exponential(multiplier=0.001, max=_LOCK_POLL_MAX_S)(state),
                               max(0.0, end - time.monotonic())),
        stop=lambda state: time.monotonic() >= end,
        reraise=True,
    )
    try:
        retrying(fcntl.flock, fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise StoreDeadlineError(f"{root}: the store lock stayed taken until the deadline; nothing was written",
                                 attempted=False) from exc


def _is_empty(path: Path) -> bool:
    """Whether a folder is empty; one another process removed meanwhile is not (nothing to do)."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return float("inf")  # gone already: nothing to remove


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``: the folders this call created, outermost first."""
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    made = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
            made.append(folder)
        except FileExistsError:  # a concurrent writer made it (and syncs its entry itself)
            pass
    return made


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
