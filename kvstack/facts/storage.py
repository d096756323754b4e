"""A fact store on disk: one safetensors file of tensors and a small JSON index naming it.

    path/index.json               {"version", "serial", "model", "embedder", "facts": [...],
                                   "tensors": file name, "sha256": of that file, "index_sha256"}
    path/facts.<serial>.safetensors
    path/index.lock               what writers lock (empty)

Each save writes a new tensors file (temporary name, fsync, rename), then the index the same
way; only then is the previous tensors file deleted. A process killed at any point leaves the
last complete save readable: the index names a file that exists whole.

**Serials and writers.** Every index carries a serial, one more than the index it replaced. A
writer holds an exclusive ``flock`` on ``index.lock`` for its whole save and names the serial it
last read or wrote (``expected_serial``; None: no store yet): when the index on disk has
another, someone else saved in between, and the save raises ``StoreChanged`` and writes nothing
instead of silently dropping that save's facts. Readers take no lock. Tensors files are named
by serial, so a save never writes over a file that an index in force names, and it removes the
old file only after its new index is in place: a reader holding the old index reads the old
tensors (whole) as long as that index is the store's; once it has opened them it reads them
after the removal too (safetensors maps the file; POSIX keeps an unlinked file's data while a
handle is open). A reader that opens them only after the removal gets ``StoreChanged``, not
``StoreCorrupted``: it read a save that is gone, and reading the index again finds the new one
(``open_store`` does). Keeping older files for slower readers would hold the store on disk
twice, and a reader pinned to one save (vLLM's connector) must refuse another one anyway.

Opening checks the index parses and has every field, the file it names exists, its SHA-256
matches and it holds every fact's K/V (``FactMemory`` checks that last); each failure raises
``StoreCorrupted`` naming the file. The index carries its own checksum too (``index_sha256``:
SHA-256 of the record without it, as canonical JSON), so an edit that keeps it valid JSON with
every field is detected as well. Version 1 indexes, written before that checksum, are read
without it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvstack.errors import InvalidArgumentError, KVStackError, StoreChanged, StoreCorrupted

INDEX = "index.json"
LOCK = "index.lock"  # held (flock, exclusive) by a writer for its whole save
VERSION = 2  # 2: the index carries index_sha256
READS = (1, 2)


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return _sha256_of(file)


def _sha256_of(file: Any) -> str:
    """The SHA-256 of an open binary file's bytes from where it stands, read 1 MiB at a time."""
    digest = hashlib.sha256()
    for block in iter(lambda: file.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)``, fsync, then rename over ``path``: readers see the old file or the
    new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def check_directory(path: str | os.PathLike) -> Path:
    """``path`` as a directory this process can write (created if missing)."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidArgumentError(
            f"path={str(path)!r} cannot be created as a directory: {error}"
        ) from None
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise InvalidArgumentError(f"path={str(path)!r} is not a writable directory")
    return directory


def has_store(path: str | os.PathLike) -> bool:
    return (Path(path) / INDEX).exists()


@contextmanager
def _writer_lock(path: Path):
    """An exclusive ``flock`` on the store's lock file, held until the block ends: one writer
    of ``path`` at a time, across processes (the lock goes with the process if it dies)."""
    with open(path / LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def write_store(
    path: Path,
    index: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    expected_serial: int | None,
) -> tuple[dict[str, Any], Any]:
    """Write ``tensors`` and then ``index`` (which gets the file's name, its checksum and the
    next serial), if the store on disk is still at ``expected_serial`` (None: no store yet);
    otherwise raise ``StoreChanged`` and write nothing. Returns the index written and its
    tensors file, opened (before any later save can remove it)."""
    if expected_serial is not None and (
        not isinstance(expected_serial, int)
        or isinstance(expected_serial, bool)
        or expected_serial < 0
    ):
        raise InvalidArgumentError(
            f"expected_serial={expected_serial!r}; expected None (no store yet) or an int >= 0 "
            "(the serial of the index last read or written)"
        )
    # Copies: the caller's tensors may be views of one buffer (an arena), which safetensors
    # refuses to write. Made before the lock: other writers need not wait for them.
    tensors = {key: t.detach().cpu().clone() for key, t in tensors.items()}
    with _writer_lock(path):
        previous = read_index(path) if has_store(path) else None
        found = None if previous is None else previous["serial"]
        if found != expected_serial:
            raise StoreChanged(
                f"fact store {path} is at serial {found!r} (saved by another writer); this "
                f"writer expected serial {expected_serial!r}, so nothing was written (reopen the "
                "store to see that save)"
            )
        serial = 0 if found is None else found + 1
        # The name carries the serial: a save never writes over the file an index in force (or a
        # reader) names, and the old file is removed only after the new index is in place.
        name = f"facts.{serial}.safetensors"
        _atomic_write(path / name, lambda tmp: save_file(tensors, str(tmp)))
        record = dict(
            index, version=VERSION, serial=serial, tensors=name, sha256=_sha256(path / name)
        )
        record["index_sha256"] = _record_sha256(record)
        text = json.dumps(record, indent=1)
        _atomic_write(path / INDEX, lambda tmp: tmp.write_text(text))
        opened = safe_open(str(path / name), framework="pt")
        for old in path.glob("facts.*.safetensors"):  # earlier saves, and any a killed save left
            if old.name != name:  # (a killed write's temporary file is removed by the next one)
                old.unlink(missing_ok=True)
    return record, opened


def _record_sha256(record: dict[str, Any]) -> str:
    """SHA-256 of an index record without its own checksum, as canonical JSON."""
    body = {key: value for key, value in record.items() if key != "index_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_index(path: Path) -> dict[str, Any]:
    file = Path(path) / INDEX
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise StoreCorrupted(f"fact store index {file} cannot be read: {error}") from None
    required = ("version", "serial", "model", "embedder", "facts", "tensors", "sha256")
    if not isinstance(record, dict):
        raise StoreCorrupted(
            f"fact store index {file} holds {type(record).__name__}; expected an object"
        )
    missing = [key for key in required if key not in record]
    if missing:
        raise StoreCorrupted(f"fact store index {file} lacks {missing}")
    if record["version"] not in READS:
        raise StoreCorrupted(
            f"fact store index {file} is version {record['version']!r}; this kvstack reads "
            f"versions {list(READS)}"
        )
    if record["version"] >= 2 and record.get("index_sha256") != _record_sha256(record):
        raise StoreCorrupted(f"fact store index {file} fails its SHA-256 check (edited or damaged)")
    return record


def open_tensors(path: Path, index: dict[str, Any]) -> Any:
    """The index's tensors file, checked against its SHA-256, opened for lazy reads. Raises
    ``StoreChanged`` when a later save has replaced it (the index on disk has moved on)."""
    file = Path(path) / index["tensors"]
    try:
        # One handle for the checksum, opened before safetensors maps the file: if a later save
        # unlinks it in between, the handle still reads the bytes that were mapped.
        handle = open(file, "rb")
    except FileNotFoundError:
        raise _missing(path, index, file) from None
    with handle:
        try:
            opened = safe_open(str(file), framework="pt")
        except Exception as error:  # the file gone since, or one safetensors cannot parse
            if not file.exists():
                raise _missing(path, index, file) from None
            raise StoreCorrupted(f"fact store tensors {file} cannot be read: {error}") from None
        sha256 = _sha256_of(handle)
    if sha256 != index["sha256"]:
        raise StoreCorrupted(f"fact store tensors {file} fails its SHA-256 check (damaged)")
    return opened


def _missing(path: Path, index: dict[str, Any], file: Path) -> KVStackError:
    """The error for a tensors file an index names that is missing: replaced by a later save
    (``StoreChanged``) when the index on disk has moved on, else damage (``StoreCorrupted``)."""
    now = read_index(path)["serial"] if has_store(path) else None
    if now != index["serial"]:
        return StoreChanged(
            f"fact store tensors {file} (serial {index['serial']}) was replaced by a later save "
            f"(the index is at serial {now!r} now); read the store again"
        )
    return StoreCorrupted(f"fact store tensors {file} named by {INDEX} is missing")


def open_store(path: Path) -> tuple[dict[str, Any], Any]:
    """The index and its tensors file, opened: read again while saves keep replacing the
    file between the two reads (a save lands between them at most once or twice in practice)."""
    for _ in range(8):
        index = read_index(path)
        try:
            return index, open_tensors(path, index)
        except StoreChanged:
            continue
    raise StoreChanged(f"fact store {path} changed on every one of 8 reads; try again later")


__all__ = [
    "StoreChanged",
    "StoreCorrupted",
    "has_store",
    "open_store",
    "open_tensors",
    "read_index",
    "write_store",
]
