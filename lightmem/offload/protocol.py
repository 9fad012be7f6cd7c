"""The reload protocol: reference counting of moved storages and the prefetch walk, run by the
offload engine (``hooks.py``, on real tensors) and the estimator (``lightmem/estimate/trace/offload_sim.py``,
on fake tensors), so a predicted reload happens where the engine's does.

An ``Entry`` is one moved storage, shared by every save of it, and is also what autograd holds for
its first save (one object per storage, most storages being saved once); each later save of the
storage gets a ``Handle`` that refers to the entry. The first save's end is not seen on its own
(the entry lives on while later saves do), so ``handles`` counts it until the entry dies: for a
storage saved by several nodes whose first node was freed by one backward and whose later nodes are
retained by the next, the reload is let go when the entry dies rather than when the last live save
has taken its view. A backward reads an entry through ``Reloads._take``: its storage is reloaded on
a miss (the owner's ``_reload`` action), a prefetched reload is taken out of the window, and once
every live save has its view the reloaded storage is let go. A handle that dies before taking its
view lets the storage go if it was the last one waiting. After each read, ``Reloads._prefetch``
reloads the entries packed just before the cursor (reverse pack order) while
``policy.prefetch_admits``.

A second backward pass over the same graph (``retain_graph``) is a new sweep: entries reloaded in
this sweep are not prefetched again, and a miss on one starts the next sweep at that entry.

The owner (a ``Reloads`` subclass) passes in the reload action, ``_reload(entry) -> storage``
(the engine's copy from host, the estimator's fake allocation; it sets nothing on the entry).
Freeing is dropping the protocol's reference to the reloaded storage (its memory returns when the
last view of it dies), and the protocol counts what is resident (``_resident_bytes``, with the
peak in ``stats``); what else a free needs is the owner's and runs before ``_discard`` (the engine
waits for an unconsumed reload's copy). Each step is written inline, never as a further call: the
engine runs ``_take`` and ``_let_go`` once per saved tensor.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from lightmem.compiled import never_traced
from lightmem.offload.policy import prefetch_admits


class Session:
    """The entries of one forward, in pack order, held weakly (for prefetch in reverse order)."""

    __slots__ = ("__weakref__", "cursor", "inflight_bytes", "refs", "sweep")

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Entry]] = []
        self.cursor = sys.maxsize  # prefetch candidates lie below it
        self.sweep = 1  # one backward pass over the entries; a second pass (retain_graph) is sweep 2
        self.inflight_bytes = 0  # prefetched reloads not yet read


class Entry:
    """One moved storage, shared by every save of it: the protocol's part of its state.

    ``alias`` (a weak reference) and ``version`` identify the save for dedupe (``same_save``);
    ``version``, ``layout`` and ``seen`` are also the first save's, as its handle (see ``Handle``).
    ``in_flight_alias`` is the device tensor held while the copy to host still runs (such an entry
    is served from it, not prefetched); the estimator's copies are instant, so it stays ``None``.
    """

    __slots__ = (
        "__weakref__",
        "alias",
        "generation",
        "handles",
        "in_flight_alias",
        "index",
        "layout",
        "nbytes",
        "owner",
        "prefetched",
        "restored",
        "seen",
        "session",
        "sweep",
        "unpacks",
        "version",
    )  # fmt: skip

    def __init__(self, owner: Reloads, nbytes: int, alias: Any, version: int) -> None:
        self.owner = owner
        self.nbytes = nbytes
        self.alias = weakref.ref(alias)  # identity, for dedupe within one forward
        self.version = version
        self.in_flight_alias: Any = None
        self.restored: Any = None  # the reloaded storage, while some save still needs it
        self.prefetched = False
        self.layout: Any = None  # the first save's (the owner sets it when the save needs one)
        self.seen = -1  # the generation the first save last took a view of
        self.handles = 1  # the first save (the entry itself), and one per live Handle
        self.unpacks = 0  # live handles that took a view of the current reload
        self.generation = 0  # bumped each time the reloaded storage is let go
        self.sweep = 0  # the session sweep of the last reload
        session = owner._session
        self.session = session
        self.index = len(session.refs)
        session.refs.append(weakref.ref(self))


class Handle:
    """What autograd holds for a later save of a moved storage (the first save holds the entry).

    ``layout`` is the owner's description of the save within the entry's storage; ``version`` the
    saved tensor's version (for the in-place check).
    """

    __slots__ = ("entry", "layout", "seen", "version")

    def __init__(self, entry: Entry, version: int, layout: Any) -> None:
        self.entry = entry
        self.version = version
        self.layout = layout
        self.seen = -1  # the entry generation this handle last took a view of
        entry.handles += 1

    @never_traced  # a graph freed between the graphs of a compiled model (lightmem.compiled)
    def __del__(self) -> None:
        entry = self.entry
        owner = entry.owner
        with owner._lock:
            entry.handles -= 1
            if self.seen == entry.generation:
                entry.unpacks -= 1
            elif entry.restored is not None and entry.handles and entry.unpacks >= entry.handles:
                owner._let_go(entry)  # the save that had not taken its view is gone


class Reloads:
    """The protocol's steps, run by an owner that provides ``_reload`` (the reload action),
    ``_lock``, ``_session`` (the current ``Session``), ``_prefetch_bytes`` (the window),
    ``_resident_bytes`` (which it may count in too) and ``stats`` (an ``OffloadStats``)."""

    __slots__ = ()

    _prefetch_bytes: int
    _resident_bytes: int
    stats: Any

    def _reload(self, entry: Any) -> Any:
        raise NotImplementedError

    def _take(self, handle: Handle | Entry, entry: Entry) -> Any:
        """The reloaded storage of ``entry`` (reloaded now on a miss) for one save of it,
        ``handle`` (the entry itself for its first save); counts the handle's view and lets the
        storage go once every live save has one."""
        restored = entry.restored
        if restored is None:
            self.stats.prefetch_misses += 1
            session = entry.session
            if entry.sweep == session.sweep:  # reloaded before in this sweep: a new backward pass
                session.sweep += 1
                session.cursor = entry.index
            elif entry.index < session.cursor:  # backward got ahead of prefetch
                session.cursor = entry.index
            restored = entry.restored = self._reload(entry)
            entry.sweep = session.sweep
            stats = self.stats
            stats.reloaded_bytes += entry.nbytes
            resident = self._resident_bytes = self._resident_bytes + entry.nbytes
            if resident > stats.peak_resident_bytes:
                stats.peak_resident_bytes = resident
        elif entry.prefetched:
            self.stats.prefetch_hits += 1
            entry.prefetched = False
            entry.session.inflight_bytes -= entry.nbytes
        if handle.seen != entry.generation:
            handle.seen = entry.generation
            entry.unpacks += 1
            if entry.unpacks >= entry.handles:  # every live save has its view: let the storage go
                self._let_go(entry)
        return restored

    def _prefetch(self, session: Session) -> None:
        """Reload the entries packed just before the cursor, within the prefetch window."""
        refs = session.refs
        index = min(session.cursor, len(refs)) - 1
        sweep = session.sweep
        while index >= 0:
            entry = refs[index]()
            if (
                entry is not None
                and entry.restored is None
                and entry.sweep != sweep
                and entry.in_flight_alias is None  # served from the device when reached
            ):
                if not prefetch_admits(session.inflight_bytes, entry.nbytes, self._prefetch_bytes):
                    return
                entry.restored = self._reload(entry)  # counted as in _take, inline
                entry.sweep = sweep
                entry.prefetched = True
                stats = self.stats
                stats.reloaded_bytes += entry.nbytes
                resident = self._resident_bytes = self._resident_bytes + entry.nbytes
                if resident > stats.peak_resident_bytes:
                    stats.peak_resident_bytes = resident
                session.inflight_bytes += entry.nbytes
            session.cursor = index
            index -= 1

    def _let_go(self, entry: Entry) -> None:
        """Every live save has its view (or is gone): the reloaded storage goes. (A prefetched
        reload is read before it can be let go: ``_take`` took it out of the window.)"""
        entry.restored = None
        entry.unpacks = 0
        entry.generation += 1
        self._resident_bytes -= entry.nbytes

    def _discard(self, entry: Entry) -> None:
        """Drop the reloaded storage of an entry that dies with it (prefetched, or not read by
        every save)."""
        if entry.prefetched:
            entry.session.inflight_bytes -= entry.nbytes
        entry.restored = None
        self._resident_bytes -= entry.nbytes
