"""The reload protocol (``lightmem.offload.protocol``) that the engine and the estimator both run:
reference counting of saves, misses, the prefetch walk within its window, a second sweep.

An owner with a recording reload action drives it directly, so the order of reloads is exact.
"""

from __future__ import annotations

import threading

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

    def read(self, handle: Handle) -> torch.Tensor:
        """What an unpack does around the protocol: take the storage, then prefetch."""
        restored = self._take(handle)
        session = handle.entry.session
        if session.cursor > 0 and self._prefetch_bytes > 0:
            self._prefetch(session)
        return restored


def _saved(owner: _Owner, count: int, nbytes: int = 100):
    aliases = [torch.empty(1) for _ in range(count)]  # kept alive: entries refer to them weakly
    entries = [Entry(owner, nbytes, alias, 0) for alias in aliases]
    return aliases, entries, [Handle(entry, 0, None) for entry in entries]


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
    entry = Entry(owner, 100, alias, 0)
    first, second, third = (Handle(entry, 0, None) for _ in range(3))
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
