"""Storage lifetimes of a fake training step: every allocation and free, in order, with its role.

``StorageTracer`` is a ``TorchDispatchMode`` that sits above ``FakeTensorMode``: it sees each op's
outputs, registers every storage it has not seen yet as an allocation, and learns of frees through
weak references on the storages. Roles (parameter, input, gradient, optimizer state, saved for
backward) are attached by the step driver as the step unfolds; the peak and its breakdown are
worked out afterwards by replaying the event list, so a late discovery (a parameter that never
receives a gradient, hence never has optimizer state) can still be taken out of the past.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightmem.devices import op_cost
from lightmem.estimate.trace.call_site import CallSite, call_site
from lightmem.estimate.trace.records import (
    ALLOCATE,
    BUFFER,
    CATEGORIES,
    FREE,
    FREE_PREVIOUS,
    GRADIENT,
    INPUT,
    OTHER,
    PARAMETER,
    STATE,
    PeakInfo,
    StepAllocations,
    StorageRecord,
    TraceWindow,
)
from lightmem.estimate.trace.values import FOLLOWED, StandIns

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
_DEVICE_QUERY = torch.ops.prim.device.default
"""``tensor.device`` on a fake tensor: dispatched (fake tensors dispatch their device), most of a
fake step's calls (~7 of 10), and neither allocates, frees nor costs anything."""


_WRITES: dict[Any, tuple[int, ...]] = {}
"""For each op met: the positions of the arguments it writes (in-place and ``out=`` ops)."""


@dataclass
class _Context:
    phase: str = "setup"
    op: str = ""
    block: str | None = None


def _cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    # CPU's attention kernel is missing from torch's FLOP registry; same count as the CUDA kernels.
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}
_PRICED_PHASES = ("forward", "backward", "optimizer")
RECOMPUTE = "recompute"
"""The phase key under which a checkpointed block's re-run in backward is priced."""
_LOG_SOFTMAX = torch.ops.aten._log_softmax.default
_SOFTMAX = torch.ops.aten._softmax.default


class StorageTracer(TorchDispatchMode):
    """Records allocations and frees of storages seen as op outputs while it is active.

    Args:
        block_bytes: the bytes the allocator hands out for a request (CUDA's caching allocator:
            ``cuda_model.cuda_block_bytes``); None: exactly the request (the CPU allocator).
        workspaces: the cuBLAS workspaces to learn from the ops and count from the start of the
            step (CUDA), or None.
    """

    def __init__(
        self,
        block_bytes: Callable[[int], int] | None = None,
        corrections: dict[Any, Any] | None = None,
        workspaces: Any = None,
    ) -> None:
        super().__init__()
        self.block_bytes = block_bytes
        self.workspaces = workspaces
        self.corrections = corrections or {}
        self.records: list[StorageRecord] = []
        self.events: list[int] = []  # rid + 1 for an allocation, -(rid + 1) for a free
        self.event_context: list[int] = []
        self._contexts: dict[tuple[str, str, str | None], int] = {}
        self._context_list: list[tuple[str, str, str | None]] = []
        self._live: dict[int, int] = {}  # id(storage) -> rid
        self._refs: dict[int, weakref.ref] = {}  # rid -> weak reference with the free callback
        self.context = _Context()
        self.window = TraceWindow()
        self.forward_block: str | None = None
        self.backward_block: str | None = None
        self.in_recompute = False
        self.in_tile_rerun = False
        """A tiled module re-runs its shards in backward (``lightmem.tiling.rerunning``): its ops are
        the backward's, not a checkpointed block's re-run."""
        self.watch: Any = None
        """With a ``position_wise.PositionWatch``, what each module's forward does along its input's
        positions is followed (the baseline step: which modules the planner may tile)."""
        self.count_flops = False
        self.block_flops: dict[str | None, float] = {}
        self.op_policy: Any = None
        """The checkpoint policy's per-op decision (``lightmem.checkpoint.op_policy``); with it, the
        forward also counts per block what op-level checkpointing keeps and what it re-runs."""
        self.block_kept_bytes: dict[str | None, int] = {}
        self.block_recompute_flops: dict[str | None, float] = {}
        self.excluded: set[int] = set()
        self.held: list[tuple[int, int, int]] = []
        """(first event, last event, bytes): memory no traced storage stands for, counted from the
        first event to the last (a what-if: what a chunked loss keeps in place of the logits)."""
        self.saved: list[int] = []  # record ids in the order autograd first saved them
        self.stand_ins: StandIns | None = None
        """Answers ops that need values fake tensors do not have (``lightmem.estimate.trace.values``)."""
        self.when_fake_refuses: Any = None
        """Called with (op, args, kwargs) when an op's fake kernel raises: returns (verdict, output,
        why) (``lightmem.estimate.device.kernels.real_output``); an output stands in for the fake one."""
        self.on_failure: Any = None
        """Called with (op, (args, kwargs), exception, what when_fake_refuses said) when an op raises."""
        self.log_softmax_inputs: list[tuple[tuple[int, ...], int, int]] = []
        """(shape, dim, record id) of each log_softmax input of the forward: the loss's logits, usually."""
        self.softmaxes: list[tuple[int, int]] = []
        """(input, output) record ids of each softmax of the forward (attention's, usually)."""
        self.log_softmax_sites: list[CallSite | None] = []
        """The user's statement behind each of ``log_softmax_inputs`` (``call_site``)."""
        self.log_prices = False
        """Log what every op of the forward, backward and optimizer step costs (``devices.op_cost``)
        into ``price_log``, for ``lightmem.estimate.pricing.fold`` to price at a device's speeds."""
        self.price_log: list[list[Any]] = []
        """Every priced op, in order: [its (phase, block) key ("forward", "backward", "optimizer", and
        "recompute" for a checkpointed block's re-run in backward; block None: outside every block),
        its ``op_cost``, its name, the block whose checkpointed re-run repeats it (an op-level
        policy's) or None]."""

    # -- allocation tracking ---------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE_QUERY:
            return func(*args)
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as error:
            real = None
            data_dependent = isinstance(error, _DATA_DEPENDENT)
            # A data-dependent output is no refusal: zeros would give it a wrong shape, silently.
            if self.when_fake_refuses is not None and not data_dependent:
                real = self.when_fake_refuses(func, args, kwargs or {})
            elif data_dependent and self.stand_ins is not None:
                answer = self.stand_ins.answer(func, args, kwargs or {}, self.known_of, self.mark_known)
                if answer is not NotImplemented:
                    real = (None, answer, "stood in")
            if real is None or real[1] is None:
                if self.on_failure is not None:
                    self.on_failure(func, (args, kwargs), error, real)
                raise
            out = real[1]
            if not isinstance(out, (torch.Tensor, tuple, list)):
                return out  # a Python value read (``.item()``, ``bool(t)``): nothing allocated
        forward = self.context.phase == "forward"
        if forward and func is _LOG_SOFTMAX:
            made = self._live.get(id(args[0].untyped_storage()), -1)
            self.log_softmax_inputs.append((tuple(args[0].shape), args[1] % max(args[0].dim(), 1), made))
            self.log_softmax_sites.append(call_site())
        correction = self.corrections.get(func)
        if correction is not None:
            out = correction(args, kwargs or {}, out)
        name = func.__name__
        self.context.op = name.removesuffix(".default")
        first = len(self.records)
        if type(out) is not tuple and type(out) is not list:
            if isinstance(out, torch.Tensor):
                self._see(out)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._see(leaf)
        if self.stand_ins is not None and func._overloadpacket in FOLLOWED:
            self.stand_ins.follow(func, args, kwargs or {}, out, self.known_of, self.mark_known)
        if forward:
            self._note_op(func, args, kwargs, first)
            if self.watch is not None and self.watch.frames:
                self.watch.op(func, args, kwargs or {}, out)
            if func is _SOFTMAX and len(self.records) > first:
                self.softmaxes.append((self._live.get(id(args[0].untyped_storage()), -1), first))
        if self.count_flops or self.log_prices:
            self._count_flops(func, out, args, kwargs or {})
        if self.workspaces is not None:
            self.workspaces.see(func, self.context.phase)
        return out

    def _note_op(self, func: Any, args: Any, kwargs: Any, first: int) -> None:
        """Keep what a forward op read on the storages it made (records from ``first``) and wrote in
        place: a few lookups, and nothing for the views that are most of a forward's ops."""
        writes = _WRITES.get(func)
        if writes is None:
            writes = _WRITES[func] = tuple(
                index for index, argument in enumerate(func._schema.arguments)
                if argument.alias_info is not None and argument.alias_info.is_write
            )  # fmt: skip
        records = self.records
        if len(records) == first and not writes:
            return
        live = self._live
        inputs: list[int] = []
        numbers: list[Any] = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                inputs.append(live.get(id(arg.untyped_storage()), -1))
            elif type(arg) is float or type(arg) is int:
                numbers.append(arg)
            elif type(arg) is list or type(arg) is tuple:
                inputs.extend(live.get(id(a.untyped_storage()), -1) for a in arg if isinstance(a, torch.Tensor))
        step = (func, tuple(inputs), tuple(numbers))
        for rid in range(first, len(records)):
            records[rid].made_by = step
        for index in writes:
            if index < len(args):
                written = args[index]
            else:
                written = (kwargs or {}).get(func._schema.arguments[index].name)
            if isinstance(written, torch.Tensor):
                rid = live.get(id(written.untyped_storage()))
                if rid is not None and rid < first:
                    record = records[rid]
                    if record.changed_by is None:
                        record.changed_by = []
                    record.changed_by.append(step)

    def _count_flops(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        packet = func._overloadpacket
        counter = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
        flops = 0.0 if counter is None else counter(*args, **kwargs, out_val=out)
        phase = self.context.phase
        logged: list[Any] | None = None
        if self.log_prices and phase in _PRICED_PHASES:
            cost = op_cost(func, args, kwargs, out, flops)
            if cost is not None:
                if phase == "forward":
                    key = (phase, self.forward_block)
                    if self.watch is not None and self.watch.frames:
                        self.watch.priced(cost)
                elif phase == "backward":
                    # A tiled module's shards run again in backward: its backward's cost, not a re-run's.
                    rerun = self.in_recompute and not self.in_tile_rerun
                    key = (RECOMPUTE, self.forward_block) if rerun else (phase, self.backward_block)
                else:
                    key = (phase, None)
                logged = [key, cost, packet.__name__, None]
                self.price_log.append(logged)
        if not self.count_flops:
            return
        block = self.forward_block
        if counter is not None:
            self.block_flops[block] = self.block_flops.get(block, 0.0) + flops
        if self.op_policy is None or block is None or self.in_recompute:
            return
        if self.op_policy.keeps(func, args, kwargs, out):
            storages = {id(leaf.untyped_storage()): leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)}
            kept = sum(self.record_of(leaf).nbytes for leaf in storages.values())
            self.block_kept_bytes[block] = self.block_kept_bytes.get(block, 0) + kept
        else:
            if flops:
                self.block_recompute_flops[block] = self.block_recompute_flops.get(block, 0.0) + flops
            if logged is not None:  # a checkpointed re-run of the block repeats it
                logged[3] = block

    def track(self, tensor: torch.Tensor, role: int = OTHER) -> int:
        """Register ``tensor``'s storage (if new) with ``role`` and return its record id."""
        rid = self._see(tensor, role)
        if role != OTHER:
            self.records[rid].role = role
        return rid

    def _see(self, tensor: torch.Tensor, role: int = OTHER) -> int:
        storage = tensor.untyped_storage()
        key = id(storage)
        rid = self._live.get(key)
        nbytes = storage.nbytes()
        if rid is not None:
            record = self.records[rid]
            if record.nbytes != self._round(nbytes):  # resized in place (an out= op, resize_)
                self._free(key, rid)
                rid = None
        if rid is None:
            rid = len(self.records)
            record = StorageRecord(self._round(nbytes), role, len(self.events), requested=nbytes)
            record.last_dim = tensor.shape[-1] if tensor.dim() else 0
            if self.in_recompute:
                record.recomputed = True
            self.records.append(record)
            self._live[key] = rid
            self._refs[rid] = weakref.ref(storage, lambda _ref, key=key, rid=rid: self._free(key, rid))
            self._push(rid + 1)
        return rid

    def _round(self, nbytes: int) -> int:
        return nbytes if self.block_bytes is None else self.block_bytes(nbytes)

    def _free(self, key: int, rid: int) -> None:
        if self._live.get(key) == rid:
            del self._live[key]
        if self._refs.pop(rid, None) is None:
            return
        self.records[rid].freed = True
        self._push(-(rid + 1))

    def _push(self, event: int) -> None:
        ctx = self.context
        block = self.forward_block if ctx.phase == "forward" else self.backward_block
        if ctx.phase == "backward" and self.in_recompute and not self.in_tile_rerun and self.forward_block is not None:
            block = self.forward_block
        key = (ctx.phase, ctx.op, block)
        cid = self._contexts.get(key)
        if cid is None:
            cid = len(self._context_list)
            self._contexts[key] = cid
            self._context_list.append(key)
        self.events.append(event)
        self.event_context.append(cid)

    # -- roles -----------------------------------------------------------------------------------

    def live_record(self, tensor: torch.Tensor) -> int | None:
        """The record id of ``tensor``'s storage while it is alive (None: never seen), registering nothing."""
        return self._live.get(id(tensor.untyped_storage()))

    def record_of(self, tensor: torch.Tensor) -> StorageRecord:
        return self.records[self._see(tensor)]

    def mark_gradient(self, tensor: torch.Tensor) -> None:
        record = self.record_of(tensor)
        if record.grad_at < 0:
            record.grad_at = len(self.events)

    def mark_saved(self, tensor: torch.Tensor, block: str | None) -> StorageRecord:
        rid = self._see(tensor)
        record = self.records[rid]
        if record.saved_at < 0:
            self.saved.append(rid)
            if self.watch is not None and self.watch.frames:
                self.watch.saved(rid, record.nbytes, record.alloc_event)
            record.saved_at = len(self.events)
            record.saved_block = block
            record.saved_shape = tuple(tensor.shape)
        return record

    def known_of(self, tensor: Any) -> Any:
        """What is assumed of ``tensor``'s values (``Known``), or None."""
        if not isinstance(tensor, torch.Tensor):
            return None
        rid = self._live.get(id(tensor.untyped_storage()))
        return self.records[rid].known if rid is not None else None

    def mark_known(self, tensor: torch.Tensor, known: Any) -> None:
        if known is not None:
            self.records[self._see(tensor)].known = known

    def mark_state(self, tensor: torch.Tensor) -> int:
        rid = self._see(tensor)
        self.records[rid].role = STATE
        return rid

    def set_phase(self, phase: str) -> None:
        self.context.phase = phase
        self.context.op = ""

    def now(self) -> int:
        return len(self.events)

    # -- analysis --------------------------------------------------------------------------------

    def category(self, record: StorageRecord, at_event: int) -> str:
        role = record.role
        if role == PARAMETER or role == BUFFER:
            return "parameters"
        if role == STATE:
            return "optimizer_state"
        if role == GRADIENT or 0 <= record.grad_at <= at_event:
            return "gradients"
        # Activations: the input batch, what forward allocated, and what backward re-creates of
        # it (checkpoint re-runs, offload reloads). Everything else is a temporary.
        if role == INPUT or record.recomputed:
            return "activations"
        if self.window.start <= record.alloc_event < self.window.forward_end:
            return "activations"
        return "temporaries"

    def peak(self) -> PeakInfo:
        """The highest live total inside the measured window and what made it up."""
        records = self.records
        start = self.window.start
        best, best_at = self._highest(self.excluded, self.held)
        # cuBLAS workspaces: allocated in an earlier step, alive throughout this one.
        workspace_bytes = 0 if self.workspaces is None else self.workspaces.total_bytes
        alive = self.alive_at(best_at)
        breakdown = dict.fromkeys(CATEGORIES, 0)
        breakdown["workspaces"] = workspace_bytes
        breakdown["temporaries"] += _held_at(self.held, best_at)
        inputs = buffers = 0
        for rid in alive:
            record = records[rid]
            breakdown[self.category(record, best_at)] += record.nbytes
            if record.role == INPUT:
                inputs += record.nbytes
            elif record.role == BUFFER:
                buffers += record.nbytes
        if best_at >= 0 and best_at < len(self.event_context):
            phase, op, block = self._context_list[self.event_context[best_at]]
        else:
            phase, op, block = "forward", "", None
        if best_at < start:
            phase, op, block = "forward", "(start of step)", None
        return PeakInfo(best, breakdown, phase, op, block, best_at, inputs, buffers)

    def peak_bytes_without(self, records: set[int], held: list[tuple[int, int, int]] | None = None) -> int:
        """The peak had ``records`` never been allocated (what a change that avoids them gives), with
        ``held`` counted (as ``self.held``) instead."""
        return self._highest(self.excluded | records, self.held + list(held or ()))[0]

    def _highest(self, excluded: set[int], held: Sequence[tuple[int, int, int]] = ()) -> tuple[int, int]:
        """(bytes, event index) of the highest live total in the window, ``excluded`` left out and
        ``held`` counted over its events."""
        records = self.records
        events = self.events
        start, end = self.window.start, self.window.end
        live = 0 if self.workspaces is None else self.workspaces.total_bytes
        for event in events[:start]:
            rid = event - 1 if event > 0 else -event - 1
            if rid in excluded:
                continue
            live += records[rid].nbytes if event > 0 else -records[rid].nbytes
        best, best_at = live, start - 1
        starts = {first for first, _, _ in held}
        for index in range(start, end):
            event = events[index]
            rid = event - 1 if event > 0 else -event - 1
            grows = index in starts
            if rid not in excluded:
                if event > 0:
                    live += records[rid].nbytes
                    grows = True
                else:
                    live -= records[rid].nbytes
            if grows:
                total = live + _held_at(held, index) if held else live
                if total > best:
                    best, best_at = total, index
        return best, best_at

    def step_allocations(self) -> StepAllocations:
        """The step's device requests in the allocator's order (``caching_allocator.replay``): what
        was made before the step (parameters, the batch, the previous step's gradients and the
        optimizer state) by role, the step's own requests and frees, and which of its storages the
        next step frees as previous gradients (this step's gradients). Excluded storages (state the
        step never has) are left out, ``held`` bytes are requested over their events; the cuBLAS
        workspaces are made before the first step."""
        records, excluded = self.records, self.excluded
        held_from: dict[int, list[int]] = {}
        held_until: dict[int, list[int]] = {}
        for first, last, nbytes in self.held:
            held_from.setdefault(first, []).append(nbytes)
            held_until.setdefault(last, []).append(nbytes)
        held_slots: dict[int, list[int]] = {}  # bytes -> slots of held requests not yet freed
        workspaces = () if self.workspaces is None else (self.workspaces.bytes_each,) * len(self.workspaces.threads)
        persistent, state, inputs = list(workspaces), [], []
        slots: dict[int, int] = {}
        sizes: list[int] = []
        events: list[tuple[int, int]] = []
        state_at = -1
        start, end = self.window.start, self.window.end
        for index, event in enumerate(self.events[:end]):
            in_step = index >= start
            for nbytes in held_from.get(index, ()) if in_step else ():
                held_slots.setdefault(nbytes, []).append(len(sizes))
                events.append((ALLOCATE, len(sizes)))
                sizes.append(nbytes)
            rid = event - 1 if event > 0 else -event - 1
            record = records[rid]
            if rid in excluded:
                pass
            elif not in_step and event > 0:
                if record.role in (PARAMETER, BUFFER):
                    persistent.append(record.requested)
                elif record.role == STATE:
                    state.append(record.requested)
                elif record.role == INPUT:
                    inputs.append(record.requested)
            else:
                if in_step and state_at < 0 and self._context_list[self.event_context[index]][0] == "optimizer":
                    state_at = len(events)
                if event > 0:
                    slots[rid] = len(sizes)
                    sizes.append(record.requested)
                    events.append((ALLOCATE, slots[rid]))
                elif rid in slots:
                    events.append((FREE, slots.pop(rid)))
                elif record.role == GRADIENT:  # the previous step's
                    events.append((FREE_PREVIOUS, record.requested))
            for nbytes in held_until.get(index, ()) if in_step else ():
                if held_slots.get(nbytes):
                    events.append((FREE, held_slots[nbytes].pop()))
        # Gradients alive at the end are the next step's previous ones where it frees those (with
        # model-state offload they leave for the host instead: freed as the step ends).
        frees_previous = any(kind == FREE_PREVIOUS for kind, _ in events)
        carried = frozenset(
            slot for rid, slot in slots.items()
            if frees_previous and (records[rid].role == GRADIENT or records[rid].grad_at >= 0)
        )  # fmt: skip
        return StepAllocations(
            tuple(persistent), tuple(state), state_at if state_at >= 0 else len(events), tuple(inputs),
            tuple(sizes), tuple(events), carried,
        )  # fmt: skip

    def block_at(self, event: int) -> str | None:
        """The block running when event ``event`` happened (None: outside every block)."""
        return self._context_list[self.event_context[event]][2]

    def alive_at(self, at_event: int) -> list[int]:
        """Record ids alive just after event ``at_event`` (excluded records left out)."""
        alive: dict[int, None] = {}
        for event in self.events[: at_event + 1]:
            if event > 0:
                alive[event - 1] = None
            else:
                alive.pop(-event - 1, None)
        return [rid for rid in alive if rid not in self.excluded]


def _held_at(held: Sequence[tuple[int, int, int]], index: int) -> int:
    """The bytes of ``held`` counted at event ``index``."""
    return sum(nbytes for first, last, nbytes in held if first <= index <= last)


