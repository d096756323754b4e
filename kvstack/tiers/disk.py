"""The disk tier: a directory of page files, each written with a checksum and an atomic rename.

A page is a few named tensors (a KV block's ``k`` and ``v``, a hybrid layer's state). Its file:

    MAGIC (8 bytes) | CRC-32 of everything after it (4, little endian)
    | header length (8, little endian)
    | header (JSON: key, and each tensor's name, dtype, shape and byte count) | tensor bytes

Each tensor's bytes start at a multiple of ``ALIGN`` bytes from the file's start (the header is
padded with spaces, the tensors with zeros): a read decodes the tensors in place, in the buffer
it read into, and typed loads need naturally aligned addresses.

Why each piece:

* **Atomic rename.** A page is written to a hidden temporary file in the same directory,
  flushed and fsynced, then ``os.replace``d onto its name, and the directory is fsynced. A
  process killed mid-write leaves only the temporary file, which the next ``DiskTier`` on the
  directory deletes: a page name always holds a whole page, the last one written under it.
* **Checksum.** Reading verifies the checksum before any byte becomes a tensor, so a flipped
  bit or a truncated file raises ``PageCorrupted`` instead of feeding wrong K/V to attention;
  so does a page whose file was deleted behind the tier's back. A CRC because the tier guards
  against accidents, not an adversary (who could rewrite the checksum with the page): it
  catches every burst of up to 32 flipped bits and any other damage but one in 2^32, at a
  fraction of a cryptographic hash's cost per byte. CRC-32C (Castagnoli, the ``crc32c``
  package) because x86's SSE 4.2 and ARMv8 compute it in hardware: a 96 KiB page in about 4 µs
  where zlib's CRC-32 takes 27 µs. That cost is paid per page per step: a decode step re-reads
  every disk page it attends to, on the prefetch worker, whose time per page is what the
  model's thread competes with. Files of the earlier formats are still read: ``KVSPAGE3``
  (zlib's CRC-32, also what a process without the ``crc32c`` package writes) and ``KVSPAGE2``
  (SHA-256, 32 bytes).
* **Read buffers are reused.** A disk read fills a buffer that its page's tensors then share.
  Fresh buffers cost more than the read: the C allocator hands the memory of a step's freed
  pages back to the kernel, and each new buffer faults its memory in again (a third of a
  page's read time here). ``ReadBuffers`` keeps the buffers of pages nobody holds any more and
  fills them again.
* **Budget.** The tier holds at most ``capacity_bytes`` of page files; a write beyond it, or a
  disk that reports ENOSPC, raises ``TierFull`` and leaves the tier as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import sys
import threading
import uuid
import zlib
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstack.errors import InvalidArgumentError, KVStackError, PageCorrupted, TierFull

try:
    import crc32c as _crc32c_module
except ImportError:  # a dependency, but an install with --no-deps may lack it: write format 3
    _crc32c_module = None

CRC32C_MAGIC = b"KVSPAGE4"  # 4: CRC-32C; 3: zlib's CRC-32; 2: SHA-256; all align to ALIGN bytes
CRC32_MAGIC = b"KVSPAGE3"
ALIGN = 64
DIGEST_BYTES = 4  # a CRC, little endian (formats 3 and 4)
# Format 2: SHA-256. Page files written before format 3 are still read; saved records (a
# conversation's manifest: small, read once per resume) are still written in it.
SHA256_MAGIC = b"KVSPAGE2"
SHA256_DIGEST_BYTES = 32
RECORD_MAGIC, RECORD_DIGEST_BYTES = SHA256_MAGIC, SHA256_DIGEST_BYTES


def _crc32c(data) -> bytes:
    if _crc32c_module is None:
        raise KVStackError(
            "this page file's checksum is CRC-32C, which needs the crc32c package (a kvstack "
            "dependency): pip install crc32c"
        )
    return _crc32c_module.crc32c(data).to_bytes(DIGEST_BYTES, "little")


def _crc32(data) -> bytes:
    return zlib.crc32(data).to_bytes(DIGEST_BYTES, "little")


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


# A page file's magic -> (its checksum's bytes, the function that computes it).
PAGE_FORMATS = {
    CRC32C_MAGIC: (DIGEST_BYTES, _crc32c),
    CRC32_MAGIC: (DIGEST_BYTES, _crc32),
    SHA256_MAGIC: (SHA256_DIGEST_BYTES, _sha256),
}
# The format pages are written in: CRC-32C where the crc32c package is there.
MAGIC = CRC32C_MAGIC if _crc32c_module is not None else CRC32_MAGIC
PAGE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"
# Page keys become file names: letters, digits, '_', '-', '.'; no leading dot (temporary files
# are hidden) and no path separators.
MAX_KEY_CHARS = 200
KEY_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{MAX_KEY_CHARS - 1}}}")

Page = dict[str, torch.Tensor]


def page_nbytes(page: Page) -> int:
    """Bytes of the page's tensors (what a memory tier holds for it)."""
    return sum(t.numel() * t.element_size() for t in page.values())


def check_key(key: str) -> None:
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise InvalidArgumentError(
            f"page key {key!r} is not usable as a file name; expected letters, digits, '_', "
            f"'-' or '.', starting with a letter or digit, at most {MAX_KEY_CHARS} characters"
        )


def encode_page(key: str, page: Page) -> bytes:
    """The page file's bytes (see the module docstring)."""
    if not page:
        raise InvalidArgumentError(f"page {key!r} has no tensors; expected at least one")
    payload = []
    for tensor in page.values():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # [numel]
        raw = flat.view(torch.uint8).numpy().tobytes()
        payload.append(raw + bytes(_padding(len(raw))))
    header = _header(key, page)
    body = struct.pack("<Q", len(header)) + header + b"".join(payload)
    return MAGIC + PAGE_FORMATS[MAGIC][1](body) + body


def page_file_bytes(key: str, page: Page) -> int:
    """The exact bytes of the file ``encode_page(key, page)`` writes (magic, checksum, header
    length, header and the aligned tensor bytes), from the tensors' shapes and dtypes alone:
    ``page`` may hold meta tensors. A disk budget must hold this, not only the K/V bytes."""
    if not page:
        raise InvalidArgumentError(f"page {key!r} has no tensors; expected at least one")
    tensors = sum(nbytes + _padding(nbytes) for nbytes in map(_tensor_nbytes, page.values()))
    return len(MAGIC) + PAGE_FORMATS[MAGIC][0] + 8 + len(_header(key, page)) + tensors


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _header(key: str, page: Page) -> bytes:
    """A page file's header: JSON naming the key and each tensor's name, dtype, shape and byte
    count, padded with spaces (which JSON ignores) so the tensors start aligned. The writer and
    ``page_file_bytes`` both build it here, so a file's size and its budget cannot drift."""
    tensors = [
        {
            "name": name,
            "dtype": str(tensor.dtype),
            "shape": list(tensor.shape),
            "nbytes": _tensor_nbytes(tensor),
        }
        for name, tensor in page.items()
    ]
    header = json.dumps({"key": key, "tensors": tensors}).encode()
    return header + b" " * _padding(len(MAGIC) + PAGE_FORMATS[MAGIC][0] + 8 + len(header))


def _padding(nbytes: int) -> int:
    """Bytes that bring ``nbytes`` up to a multiple of ``ALIGN``."""
    return -nbytes % ALIGN


def decode_page(data: bytes | bytearray, source: str) -> tuple[str, Page]:
    """(key, page) from a page file's bytes; raises ``PageCorrupted`` naming ``source`` when the
    bytes are not a whole page as written. The tensors share ``data``'s memory when it is a
    ``bytearray`` (a disk read: no copy after the read), else one writable copy of it."""
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    view = memoryview(buffer)
    digest_bytes, checksum = PAGE_FORMATS.get(bytes(view[: len(MAGIC)]), (None, None))
    head = len(MAGIC) + (digest_bytes or 0)
    if checksum is None or len(buffer) < head + 8:
        raise PageCorrupted(f"{source}: not a kvstack page file (bad magic or truncated)")
    digest = bytes(view[len(MAGIC) : head])
    actual = checksum(view[head:])
    if actual != digest:
        raise PageCorrupted(
            f"{source}: checksum mismatch (stored {digest.hex()[:16]}…, computed "
            f"{actual.hex()[:16]}…); the page is not used"
        )
    (header_len,) = struct.unpack_from("<Q", buffer, head)
    offset = head + 8
    header = _parsed_header(bytes(view[offset : offset + header_len]))
    offset += header_len
    page: Page = {}
    for spec in header["tensors"]:
        dtype = getattr(torch, spec["dtype"].removeprefix("torch."))
        if not spec["nbytes"]:  # frombuffer refuses an empty buffer
            page[spec["name"]] = torch.empty(spec["shape"], dtype=dtype)
            continue
        count = spec["nbytes"] // dtype.itemsize  # the offset is a multiple of ALIGN: aligned
        page[spec["name"]] = _tensor_in(buffer, dtype, offset, count, spec["shape"])
        offset += spec["nbytes"] + _padding(spec["nbytes"])
    return header["key"], page


# A page header's bytes -> its parsed JSON: a decode step re-reads the same pages, and parsing
# their headers again was a tenth of a page's read on the prefetch worker. Emptied when full.
_HEADERS: dict[bytes, dict] = {}
_HEADERS_KEPT = 8192


def _parsed_header(header: bytes) -> dict:
    parsed = _HEADERS.get(header)
    if parsed is None:
        parsed = json.loads(header)
        if len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.clear()
        _HEADERS[header] = parsed
    return parsed


# torch dtype -> the numpy dtype of the same bytes (bfloat16 and the float8s have none).
_NUMPY_DTYPES = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def _tensor_in(
    buffer: bytearray, dtype: torch.dtype, offset: int, count: int, shape: list[int]
) -> torch.Tensor:
    """The tensor of ``count`` ``dtype`` values at ``offset`` in ``buffer``, shaped ``shape``,
    sharing its memory. Through numpy where it has the dtype: numpy's frombuffer and reshape
    keep the GIL and take about a microsecond each, while torch's frombuffer and view each let
    go of it and take it back, and on the prefetch worker each taking back waits for the
    model's thread, which then waits for the worker (half the worker's time per page went
    there)."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        flat = torch.frombuffer(buffer, dtype=dtype, offset=offset, count=count)  # [numel]
        return flat.view(shape)  # [numel] -> shape
    return torch.from_numpy(np.frombuffer(buffer, numpy_dtype, count, offset).reshape(shape))


def _references_of_a_pooled_buffer() -> int:
    """What ``sys.getrefcount`` reports, in ``ReadBuffers.take``, for a buffer that only the pool
    refers to (the deque, the local name, the call's argument: 3 on CPython 3.11), measured the
    way ``take`` looks, so an interpreter that counts stack references differently agrees."""
    pool = deque([bytearray(1)])
    buffer = pool[0]
    return sys.getrefcount(buffer)


_POOLED_ONLY = _references_of_a_pooled_buffer()


class ReadBuffers:
    """Buffers for page reads, each filled again once no page's tensors share it.

    A page's tensors share its buffer: ``_tensor_in`` makes them through numpy's
    ``frombuffer`` (or ``torch.frombuffer`` for dtypes numpy lacks, such as bfloat16), and
    either holds a reference to the buffer (through the buffer protocol) until the tensor's
    storage is freed. So a buffer that only this pool refers to is one no page uses: CPython's
    reference count says so exactly. Pages are read and dropped in about
    the order of their reads (a layer at a time), so the oldest buffers are checked first and
    only a few: a read never scans the pool. At most ``max_bytes`` are kept; a read that finds
    no free buffer of its size allocates one (and keeps it while there is room). Thread-safe:
    the prefetch worker and the model's thread both read pages.

    The pool is host memory outside every tier's budget: ``held_bytes`` (at most ``max_bytes``)
    is reported in the store's ``stats()`` as ``disk_read_buffer_bytes``. Buffers that pages
    still share are counted there too; they hold those pages' K/V while attention reads it."""

    CHECKED = 4  # the oldest buffers looked at per read

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self._pool: deque[bytearray] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # reads that filled a pooled buffer again (for tests and accounting)

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers the pool keeps (free or shared by pages' tensors)."""
        return self._bytes

    def take(self, nbytes: int) -> bytearray:
        """A buffer of ``nbytes`` that no page's tensors share (its bytes are stale)."""
        with self._lock:
            for _ in range(min(self.CHECKED, len(self._pool))):
                buffer = self._pool[0]
                self._pool.rotate(-1)  # checked: to the back, behind the younger ones
                if len(buffer) == nbytes and sys.getrefcount(buffer) == _POOLED_ONLY:
                    self.reused += 1
                    return buffer
                del buffer
            buffer = bytearray(nbytes)
            if self._bytes + nbytes <= self.max_bytes:
                self._pool.append(buffer)
                self._bytes += nbytes
            return buffer


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that named this temporary file (``.NAME.PID.UUID.tmp``) still runs:
    its write may be in progress, so it is not swept."""
    parts = temp_name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process has no write in progress while it opens a tier
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_all(handle, data: bytes) -> None:
    """Write and flush to the device (the one place a full disk shows up: tests replace it to
    simulate ENOSPC)."""
    handle.write(data)
    handle.flush()
    os.fsync(handle.fileno())


class OpenedPage(NamedTuple):
    """A page file opened for reading (``DiskTier.open``)."""

    handle: Any  # the file, unbuffered
    nbytes: int  # the bytes the tier wrote to it
    source: str  # its path, for errors


class DiskTier:
    """Pages in files under ``path`` (created if missing), at most ``capacity_bytes`` of them.

    Opening a directory that holds pages finds them (a new process resumes where the last one
    stopped) and deletes temporary files that a killed write left behind."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int) -> None:
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes!r}; expected a positive number of bytes"
            )
        directory = Path(path)
        try:
            if not directory.exists():
                directory.mkdir(parents=True)
        except OSError as error:
            raise InvalidArgumentError(
                f"disk_path={str(directory)!r} cannot be created ({error.strerror}); expected a "
                "writable directory"
            ) from None
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise InvalidArgumentError(
                f"disk_path={str(directory)!r} is not a writable directory; expected one the "
                "process can create files in"
            )
        self.path = directory
        self._directory = str(directory)  # for page reads: os.path.join is cheaper than Path
        self.capacity_bytes = capacity_bytes
        self.read_buffers = ReadBuffers()
        self._sizes: dict[str, int] = {}  # key -> bytes of its file
        for entry in directory.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX):
                if not _writer_alive(entry.name):
                    entry.unlink(missing_ok=True)  # a write that never reached its rename
            elif entry.name.endswith(PAGE_SUFFIX):
                self._sizes[entry.name.removesuffix(PAGE_SUFFIX)] = entry.stat().st_size
        if self.bytes_used > capacity_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes} is less than the {self.bytes_used} bytes of "
                f"pages already in {str(directory)!r}; expected at least that much"
            )

    # ------------------------------------------------------------------ queries
    @property
    def bytes_used(self) -> int:
        return sum(self._sizes.values())

    @property
    def bytes_free(self) -> int:
        return self.capacity_bytes - self.bytes_used

    def keys(self) -> list[str]:
        return sorted(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def file_of(self, key: str) -> Path:
        return self.path / f"{key}{PAGE_SUFFIX}"

    def file_bytes_or_zero(self, key: str) -> int:
        return self._sizes.get(key, 0)

    # ------------------------------------------------------------------ writes and reads
    def write(self, key: str, page: Page) -> int:
        """Write ``page`` under ``key`` (replacing a page of that key atomically); returns the
        file's bytes. Raises ``TierFull`` (nothing written) when the budget or the disk
        cannot take it."""
        check_key(key)
        return self.write_encoded(key, encode_page(key, page))

    def write_encoded(self, key: str, data: bytes) -> int:
        """``write`` of a page already encoded by ``encode_page(key, page)``."""
        check_key(key)
        free = self.bytes_free + self._sizes.get(key, 0)
        if len(data) > free:
            raise TierFull(
                f"disk tier {str(self.path)!r}: page {key!r} needs {len(data)} bytes, "
                f"{free} of capacity_bytes={self.capacity_bytes} are free"
            )
        self._replace_atomically(self.file_of(key), data, f"page {key!r}")
        self._sizes[key] = len(data)
        return len(data)

    def _replace_atomically(self, target: Path, data: bytes, what: str) -> None:
        """Write ``data`` to a hidden temporary file, fsync it, rename it onto ``target`` and
        fsync the directory: ``target`` holds either its old bytes or all of ``data``."""
        temp = self.path / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}{TEMP_SUFFIX}"
        try:
            with open(temp, "xb") as handle:
                _write_all(handle, data)
            os.replace(temp, target)
        except OSError as error:
            temp.unlink(missing_ok=True)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(
                    f"disk tier {str(self.path)!r}: the disk is full writing {what} "
                    f"({len(data)} bytes); nothing was written"
                ) from error
            raise
        self._fsync_directory()

    def write_record(self, name: str, record: dict) -> None:
        """Store a small JSON record (a saved conversation's manifest) under ``name`` (a file
        name ending in ``.json``), atomically and with a checksum, like a page."""
        body = json.dumps(record, sort_keys=True).encode()
        data = RECORD_MAGIC + _sha256(body) + body
        self._replace_atomically(self.path / name, data, f"record {name!r}")

    def delete_record(self, name: str) -> None:
        """Remove the record under ``name`` (nothing if there is none)."""
        (self.path / name).unlink(missing_ok=True)
        self._fsync_directory()

    def read_record(self, name: str) -> dict | None:
        """The record under ``name`` (None if there is none); ``PageCorrupted`` if damaged."""
        return self.read_record_at(self.path, name)

    @staticmethod
    def read_record_at(directory: Path, name: str) -> dict | None:
        """``read_record`` without opening a tier (which would sweep the directory)."""
        source = Path(directory) / name
        if not source.exists():
            return None
        data = source.read_bytes()
        head = len(RECORD_MAGIC) + RECORD_DIGEST_BYTES
        body = data[head:]
        if (
            data[: len(RECORD_MAGIC)] != RECORD_MAGIC
            or _sha256(body) != data[len(RECORD_MAGIC) : head]
        ):
            raise PageCorrupted(f"{source}: checksum mismatch or not a kvstack record")
        return json.loads(body)

    def read(self, key: str) -> Page:
        """The page under ``key``, checked against its checksum (``PageCorrupted`` if not)."""
        return self.read_opened(key, self.open(key))

    def open(self, key: str) -> OpenedPage:
        """An open handle on ``key``'s file, with the bytes the tier wrote there: the cheap step
        a caller does under its lock. The file stays readable through the handle even if the
        page is deleted or replaced after."""
        nbytes = self._sizes.get(key)
        if nbytes is None:
            raise KeyError(f"page {key!r} is not on the disk tier {str(self.path)!r}")
        source = os.path.join(self._directory, key + PAGE_SUFFIX)  # cheaper than a Path
        try:
            return OpenedPage(open(source, "rb", buffering=0), nbytes, source)
        except FileNotFoundError as error:
            # Deleted behind the tier's back (a cleaner, a user): the page is lost exactly as a
            # damaged one is, and lossless callers recompute it the same way.
            raise PageCorrupted(f"{source}: the page file is missing") from error

    def read_opened(self, key: str, opened: OpenedPage) -> Page:
        """Read, check and decode the page ``open(key)`` opened, closing its handle. The size is
        the one the tier wrote (no fstat: one system call less, and each call lets go of the
        GIL and waits to take it back); a file changed behind the tier's back reads short or
        long and fails the checksum."""
        with opened.handle as handle:
            data = self.read_buffers.take(opened.nbytes)  # decoded in place
            view, done = memoryview(data), 0
            while done < len(data):  # one readinto returns at most ~2 GiB
                count = handle.readinto(view[done:])
                if not count:
                    break
                done += count
            del view
            if done < len(data):  # a file that shrank meanwhile fails the checks below
                data = bytearray(data[:done])  # (the pooled buffer keeps its size)
        stored_key, page = decode_page(data, opened.source)
        if stored_key != key:
            raise PageCorrupted(f"{opened.source}: holds page {stored_key!r}, expected {key!r}")
        return page

    def delete(self, key: str) -> None:
        """Remove ``key``'s file (nothing if the tier holds no such page). The file goes first,
        its accounting after: an unlink that fails (``OSError``) leaves the page named, counted
        and readable, never a name without its file or a file the tier no longer counts."""
        if key not in self._sizes:
            return
        self.file_of(key).unlink(missing_ok=True)
        del self._sizes[key]

    def _fsync_directory(self) -> None:
        """Make the rename itself durable (POSIX: the directory entry lives in the directory)."""
        try:
            descriptor = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # platforms without directory descriptors
        try:
            os.fsync(descriptor)
        except OSError:
            pass
        finally:
            os.close(descriptor)

    def __repr__(self) -> str:
        return (
            f"DiskTier({str(self.path)!r}, {len(self._sizes)} pages, {self.bytes_used} of "
            f"{self.capacity_bytes} bytes)"
        )
