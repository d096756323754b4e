"""Errors raised by kvstack.

Every error names the argument, the value it got and what was expected. Operations that
raise leave their objects unchanged (they validate everything before they mutate anything).
This module imports nothing from the rest of kvstack, so every layer may use it.
"""


class KVStackError(Exception):
    """Base class of every error kvstack raises on purpose."""


class InvalidArgumentError(KVStackError, ValueError):
    """An argument has the wrong value, shape or device."""


class InvalidDTypeError(KVStackError, TypeError):
    """An argument has the wrong dtype or type."""


class SlotOutOfRangeError(KVStackError, IndexError):
    """A slot, block or token index lies outside the structure it indexes."""


class PoolExhausted(KVStackError, MemoryError):
    """The block pool cannot hand out as many blocks as were asked for; nothing was allocated."""


class ArenaExhausted(PoolExhausted):
    """A KV arena cannot hold the pages asked for, even after compaction; the message names the
    bytes needed and the bytes free. Nothing was allocated and no other cache changed."""


class DoubleFreeError(KVStackError):
    """A block was freed that is not currently allocated."""


class DeadTokenError(KVStackError):
    """A token that is already evicted (or was never appended) was named for eviction."""


class BackendUnavailable(KVStackError, RuntimeError):
    """A requested backend of an operation cannot run on this machine; the message says why."""


class TierFull(KVStackError, MemoryError):
    """A memory or disk tier cannot take a page: its budget is spent and room could not be made
    (dropping copies, demoting pages one tier down, in lossless mode dropping K/V pages), or the
    disk is full (ENOSPC). The message names the tier, the bytes asked for and the bytes free.
    The page asked for was not written and did not change its home; pages demoted or dropped on
    the way stay where they went (whole, or recorded as dropped)."""


class PageCorrupted(KVStackError):
    """A page read back from disk does not match the checksum it was written with (or is not
    a kvstack page file at all); the message names the file. Its bytes are never returned."""


class StoreCorrupted(KVStackError):
    """A fact store's index or tensors file is missing, unreadable or fails its checksum: the
    store is not opened, and nothing is read from it."""


class StoreChanged(KVStackError):
    """A fact store was saved by another writer since this one read it (its index has another
    serial than the one expected), or the save a reader's index names has been replaced. A
    write that raises it wrote nothing; a read that raises it read nothing."""
