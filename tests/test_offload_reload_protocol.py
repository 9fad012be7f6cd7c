"""The reload protocol (``lightmem.offload.protocol``) that the engine and the estimator both run:
reference counting of saves, misses, the prefetch walk within its window, a second sweep.

An owner with a recording reload action drives it directly, so the order of reloads is exact. As
in the engine, an entry is its first save's handle and each later save of it holds a ``Handle``.
"""

from __future__ import annotations

import threading
import weakref

import torch

from lightmem.offload.protocol import Entry, Handle, Reloads, Session
from lightmem.offload.stats import OffloadStats


class _Owner(Reloads):
    def __init__(self, window: int) -> None:
        self._lock = threading.RLock()
        self._session = Session()
        self._prefetch_bytes = window
        self._resident_bytes = 0
        self.stats = OffloadStats()
        self.reloads: list[int] = []

    def _reload(self, entry: Entry) -> torch.Tensor:
        self.reloads.append(entry.index)
        return torch.zeros(entry.nbytes, dtype=torch.uint8)

    def read(self, handle: Entry | Handle) -> torch.Tensor:
        """What an unpack does around the protocol: take the storage, then prefetch."""
        entry = handle if isinstance(handle, Entry) else handle.entry
        restored = self._take(handle, entry)
        session = entry.session
        if session.cursor > 0 and self._prefetch_bytes > 0:
            self._prefetch(session)
        return restored


class _DiscardingEntry(Entry):
    """An entry that drops its reload when it dies, as the engine's and the estimator's do."""

    __slots__ = ()

    def __del__(self) -> None:
        if self.restored is not None:
            self.owner._discard(self)


def _saved(owner: _Owner, count: int, nbytes: int = 100):
    aliases = [torch.empty(1) for _ in range(count)]  # kept alive: entries refer to them weakly
    entries = [Entry(owner, nbytes, alias, 0) for alias in aliases]
    return aliases, entries, list(entries)  # each storage saved once: the entry is the handle


def test_backward_reloads_in_reverse_pack_order_within_the_window():
    owner = _Owner(window=200)
    _aliases, entries, handles = _saved(owner, 5)
    for handle in reversed(handles):
        assert owner.read(handle).numel() == 100
    assert owner.reloads == [4, 3, 2, 1, 0]  # one miss, then two ahead at a time
    stats = owner.stats
    assert (stats.prefetch_misses, stats.prefetch_hits, stats.reloaded_bytes) == (1, 4, 500)
    assert stats.peak_resident_bytes == 200 and owner._resident_bytes == 0
    assert all(entry.restored is None for entry in entries) and owner._session.inflight_bytes == 0


def test_a_second_backward_is_a_new_sweep():
    owner = _Owner(window=100)
    _aliases, _entries, handles = _saved(owner, 3)
    for _ in range(2):  # retain_graph: the same handles read twice
        for handle in reversed(handles):
            owner.read(handle)
    assert owner.reloads == [2, 1, 0, 2, 1, 0]
    assert (owner.stats.prefetch_misses, owner.stats.prefetch_hits) == (2, 4)


def test_a_storage_goes_when_every_live_save_has_its_view():
    owner = _Owner(window=0)
    alias = torch.empty(1)
    first = entry = Entry(owner, 100, alias, 0)  # the first save holds the entry
    second, third = (Handle(entry, 0, None) for _ in range(2))
    assert entry.handles == 3
    owner.read(first)
    assert entry.restored is not None and owner._resident_bytes == 100
    del third  # a save dropped unread: two live saves, one of them still waiting
    assert entry.restored is not None
    owner.read(second)  # the last live save took its view
    assert entry.restored is None and owner._resident_bytes == 0
    owner.read(first)  # read again: a new sweep reloads it, and the other save still waits
    assert entry.restored is not None
    del second  # the save still waiting is gone: the storage goes
    assert entry.restored is None and owner._resident_bytes == 0 and entry.handles == 1
    assert owner.reloads == [0, 0] and owner.stats.prefetch_misses == 2


def test_the_first_save_counts_until_its_entry_dies():
    """The first save's end is not seen on its own: while a later save lives, a reload it took is
    let go only when that save dies too (and with it the entry, whose owner discards the reload)."""
    owner = _Owner(window=0)
    alias = torch.empty(1)
    entry = _DiscardingEntry(owner, 100, alias, 0)
    second = Handle(entry, 0, None)
    owner.read(entry)
    owner.read(second)  # both saves have their view: let go
    assert entry.restored is None and owner._resident_bytes == 0
    entry_ref = weakref.ref(entry)
    del entry  # the first save's node is freed; the later save still holds the entry
    owner.read(second)  # a new sweep reloads it for the later save alone
    assert entry_ref().restored is not None and entry_ref().handles == 2 and entry_ref().unpacks == 1
    del second  # the last save is gone, and with it the entry and its reload
    assert entry_ref() is None and owner._resident_bytes == 0 and owner.reloads == [0, 0]
