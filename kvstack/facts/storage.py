"""A fact store on disk: one safetensors file of tensors and a small JSON index naming it.

    path/index.json               {"version", "model", "embedder", "facts": [...], "tensors":
                                   file name, "sha256": of that file}
    path/facts.<serial>.safetensors

Each save writes a new tensors file (temporary name, fsync, rename), then the index the same
way; only then is the previous tensors file deleted. A process killed at any point leaves the
last complete save readable: the index names a file that exists whole. Opening checks the
index parses and has every field, the file it names exists, its SHA-256 matches and it holds
every fact's K/V (``FactMemory`` checks that last); each failure raises ``StoreCorrupted``
naming the file. The index carries its own checksum too (``index_sha256``: SHA-256 of the
record without it, as canonical JSON), so an edit that keeps it valid JSON with every field is
detected as well. Version 1 indexes, written before that checksum, are read without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvstack.errors import InvalidArgumentError, StoreCorrupted

INDEX = "index.json"
VERSION = 2  # 2: the index carries index_sha256
READS = (1, 2)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
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


def write_store(path: Path, index: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` and then ``index`` (which gets the file's name and checksum)."""
    previous = read_index(path) if has_store(path) else None
    serial = (previous["serial"] + 1) if previous else 0
    name = f"facts.{serial}.safetensors"
    # Copies: the caller's tensors may be views of one buffer (an arena), which safetensors
    # refuses to write.
    tensors = {key: t.detach().cpu().clone() for key, t in tensors.items()}
    _atomic_write(path / name, lambda tmp: save_file(tensors, str(tmp)))
    record = dict(index, version=VERSION, serial=serial, tensors=name, sha256=_sha256(path / name))
    record["index_sha256"] = _record_sha256(record)
    text = json.dumps(record, indent=1)
    _atomic_write(path / INDEX, lambda tmp: tmp.write_text(text))
    for old in path.glob("facts.*.safetensors"):  # earlier saves, and any a killed save left
        if old.name != name:  # (a killed write's temporary file is removed by the next one)
            old.unlink(missing_ok=True)


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
    """The index's tensors file, checked against its SHA-256, opened for lazy reads."""
    file = Path(path) / index["tensors"]
    if not file.exists():
        raise StoreCorrupted(f"fact store tensors {file} named by {INDEX} is missing")
    if _sha256(file) != index["sha256"]:
        raise StoreCorrupted(f"fact store tensors {file} fails its SHA-256 check (damaged)")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # the checksum matched a file safetensors cannot parse
        raise StoreCorrupted(f"fact store tensors {file} cannot be read: {error}") from None


__all__ = ["StoreCorrupted", "has_store", "open_tensors", "read_index", "write_store"]
