"""``Options(budget_covers="step")``: the engine's side of a budget for every tensor of the step.

The scheduler says how much of such a budget the managed tensors get once the step was
recorded whole (``scheduler/whole_step.py``); this module says what the engine gives them
before that, on the step that records, and keeps the two in ``EngineMemory``: ``step_budget``
(the budget given), ``budget`` (the managed tensors' share), ``step_start`` (what a step
starts with) and ``step_held`` (the most the recorded step held beside its managed tensors).

The recording step cannot know what PyTorch will hold beside its managed tensors (the
backward's gradients of activations, its temporaries) until it ran; what it starts with
(weights, buffers, optimizer state, gradients kept from the last step) it can. So it holds
its managed tensors within the budget less those bytes and the CPU allocator's cache, and,
where the device's live bytes are counted (``on_demand_bound``), evicts them for what PyTorch
holds too: only PyTorch's own bytes over the budget go over it, and the step's end refuses it.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch._C import DisableTorchFunctionSubclass

from ooc.engine.lifetime import recycle_bytes
from ooc.engine.memory import EngineMemory
from ooc.host import cpu_allocator
from ooc.record import roles
from ooc.record.storages import sparse_parts
from ooc.runtime.dry_run import update_held
from scheduler.beside import HELD_BESIDE
from scheduler.errors import BudgetTooSmall
from scheduler.ir import VariableSequence
from scheduler.managed import kinds_of
from scheduler.whole_step import held_beside, least_budget, managed_budget, share_beside
from vmm.units import format_size

log = logging.getLogger(__name__)


# Bytes of Python objects the engine keeps per function of a step it recorded (its
# ``Function``s and their uses, working sets, what each op held beside, the timeline's last
# steps) and makes while it plans it. tracemalloc's peak over a step, from the second on, was
# 4.9-5.6 KiB a function of the whole step (its update's ops too) for 2-layer Hugging Face
# GPT-2, BERT and Llama models and a small CNN (500-1,050 functions), 6.6 for the GPT-2 whose
# batch size varied (its plan widened to sizes that vary), and 2.8 for an MLP of 120 modules
# (``test_refusal_loop.py::test_the_engines_records_are_within_what_a_step_budget_keeps_for_them``).
# Those figures held up to three sequences more than the engine's own, in a cache of the chains
# found in them (``scheduler.replay``); without it, 4.4 (Llama), 5.1 (BERT) and 5.5 (GPT-2, its
# batch size fixed or varied), the most in the steps that price the plan again: 7 KiB keeps a
# fifth over the most. Plans kept for other shapes are held to ``PLANS_IN_RECORDS`` steps'
# worth (with the cache and sixteen plans kept, four shapes of a GPT-2 of 128 wide had peaked
# at 7.8 KiB a function).
RECORD_BYTES = 7 << 10
# Plans kept, in steps of the largest counted (``plans_over_records``): every plan holds its
# step's sequence, and those figures held one or two. A GPT-2 of 128 wide whose batch size
# cycled over four sizes kept three plans of 727 functions at 5.8 KiB a function at its peak.
PLANS_IN_RECORDS = 4


def cache_reserve(budget: int, on_cpu: bool) -> int:
    """Bytes of a step budget kept for the CPU allocator's cache of freed pages (none on a GPU,
    whose caching allocator's blocks are what it holds)."""
    return recycle_bytes(budget, whole_step=True) if on_cpu else 0


def records_bytes(functions: int, on_cpu: bool) -> int:
    """Bytes of a step budget kept for the engine's own records of a step of ``functions``
    functions (``RECORD_BYTES`` each). On the CPU they are the device's memory: uncounted, a
    small Hugging Face GPT-2 (727 functions) peaked 3-4 MiB over its least step budget of
    52 MiB. On a GPU they are the host's."""
    return functions * RECORD_BYTES if on_cpu else 0


def plans_over_records(functions: list[int], mem: EngineMemory) -> bool:
    """Whether plans of ``functions`` functions each are more than what the budget keeps for the
    engine's records counts: ``PLANS_IN_RECORDS`` steps of the largest it counted (or of the
    largest plan, whose sequence may list a few ops more than the whole recording counts). Why:
    every plan holds its step's sequence, and a step budget counts the records of one. Kept by
    count alone (``Options.max_plans``), a two-layer LSTM over packed sequences whose lengths
    never repeat (each step a plan of ~13,000 functions) held 13 plans after 40 steps, 58 MiB of
    Python objects and 73 MiB at a step's peak, growing; held to four, 24-41 MiB between steps
    and at most 64 within one, under the 94 MiB its step budget keeps for records."""
    return bool(mem.step_records) and sum(functions) > PLANS_IN_RECORDS * max(
        mem.step_records // RECORD_BYTES, *functions)


def kept_back(budget: int, mem: EngineMemory) -> int:
    """What a step budget keeps beside every tensor: the CPU allocator's cache and the engine's
    records (``mem.step_records``)."""
    return cache_reserve(budget, mem.on_cpu) + mem.step_records


def kept_words(budget: int, mem: EngineMemory) -> str:
    """What ``kept_back`` is made of, in a refusal's words. Why: the records grow with the
    step's ops, not its bytes. Hugging Face's RWKV, whose CPU path loops over the tokens in
    Python, runs 9,500 ops a step at 2 layers and 32 tokens: of its least step budget, 77 MiB,
    65 MiB were the records' (its tensors needed under 4), and the note said only "the
    CPU allocator's cache, the engine's records"."""
    parts, cache = [], cache_reserve(budget, mem.on_cpu)
    if cache:
        parts.append(f"{format_size(cache)} for the CPU allocator's cache of freed pages")
    if mem.step_records:
        parts.append(f"{format_size(mem.step_records)} for the engine's records of the step's "
                     f"{mem.step_records // RECORD_BYTES:,} ops ({format_size(RECORD_BYTES)} each, the same for any "
                     f"op: fewer, larger ops, such as a fused kernel for a loop over time steps, need less)")
    return ", ".join(parts)


def start_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                manage: frozenset[str] | set[str] = frozenset({"activations"}), min_bytes: int = 0) -> int:
    """Bytes a step starts with beside its managed tensors: weights, buffers, gradients kept
    from the last step and the optimizer's state, each storage once, less those of the kinds
    ``manage``d (from ``min_bytes`` on: the managed budget holds them; counted here too, they
    left a recording step with every kind managed one chunk, and its first swap-in failed)."""
    return sum(s.nbytes() for s in start_storages(model, optimizer, manage, min_bytes))


def start_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   manage: frozenset[str] | set[str], min_bytes: int) -> list[torch.UntypedStorage]:
    """The storages ``start_bytes`` counts: each tensor's as it is now, one on the tier empty
    (its class's ``__torch_function__`` off: between steps a watched tensor's storage is a use
    that reads it back, and counting them read a VAE's Adam state back at every step's end,
    18 MiB over the 30 MiB budget of the next step's start)."""
    with DisableTorchFunctionSubclass():
        return _start_storages(model, optimizer, manage, min_bytes)


def _start_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    manage: frozenset[str] | set[str], min_bytes: int) -> list[torch.UntypedStorage]:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    state = [t for st in optimizer.state.values() for v in st.values()   # LBFGS keeps lists of them
             for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)
             ] if optimizer is not None else []
    storages = {}
    for tensors, kind in ((model.parameters(), "params"), (model.buffers(), None), (grads, "grads"),
                          (state, "optimizer_state")):
        for t in tensors:
            # each storage once, by its StorageImpl (no data pointer needed: a ZeroTensor
            # gradient, as sgn's, has none, and holds nothing)
            if t.layout is not torch.strided:   # sparse (SGD's momentum of a sparse gradient):
                for part in (x.untyped_storage() for x in sparse_parts(t)):   # never managed: counted
                    storages[part._cdata] = part
                continue
            s = t.untyped_storage()
            if not t._is_zerotensor() and not _managed(kind, s.nbytes(), manage, min_bytes):
                storages[s._cdata] = s
    return list(storages.values())


def _managed(kind: str | None, nbytes: int, manage: frozenset[str] | set[str], min_bytes: int) -> bool:
    """Whether ooc manages a tensor of ``kind`` ("params", "grads", "optimizer_state"; None:
    a buffer, never) and ``nbytes``: a kind ``manage``d, from ``min_bytes`` on."""
    return kind in manage and nbytes >= min_bytes


def _room(budget: int, mem: EngineMemory, held: bool = False) -> int:
    """What ``budget`` leaves the managed tensors: beside what a step starts with (the
    recording step's), or, ``held``, beside the most the step recorded whole held (in each arena)."""
    return share_beside(budget, mem.step_held if held else mem.step_start,
                        reserve=lambda b: kept_back(b, mem), arenas=_arenas(mem) if held else 1,
                        granule=mem.chunk)


def recording_room(mem: EngineMemory) -> int:
    """What a recording step's managed tensors may hold under ``mem.step_budget``: the budget
    less the cache and what the step starts with (``mem.step_start``), in whole chunks, at
    least one (a budget under what the step needs fails at its end, naming the minimum)."""
    return max(_room(mem.step_budget, mem), mem.chunk)


def _arenas(mem: EngineMemory) -> int:
    """2 where a GPU pool's chunks sit beside PyTorch's cache (each gets the share), else 1."""
    return 2 if not mem.on_cpu and mem.arena == "pool" else 1


def device_budget(mem: EngineMemory) -> int:
    """What a plan bounded by the step's budget may hold with what the step holds beside it
    (``scheduler.beside``): the step budget less what it keeps back (``kept_back``), with one arena (the CPU;
    a GPU's swap-ins in PyTorch's allocator, ``Options(arena="pytorch")``); else 0, the flat
    share: ooc's pool beside PyTorch's allocator cannot take what PyTorch frees."""
    if not mem.step_budget or _arenas(mem) != 1:
        return 0
    return mem.step_budget - kept_back(mem.step_budget, mem)


def allocator_room(mem: EngineMemory, whole: VariableSequence) -> int:
    """What the CPU allocator's live and cached blocks may hold together under a budget for the
    whole step (``cpu_allocator.begin``'s ``total_bytes``): ``mem.step_budget`` less the most
    that the step's tensors under ``cpu_allocator.LARGE``, glibc's, held at once in its whole
    recording, less what the budget keeps back (``kept_back``: the cache's share, kept for what
    no recording counts: without it a 2-layer Llama's steps rose 2 MiB and a GPT-2's went over;
    the engine's records). Beyond its share the cache may keep only what that room leaves it."""
    small = lambda nbytes: nbytes if nbytes < cpu_allocator.LARGE else 0   # noqa: E731
    glibc = max((a + b for a, b in zip(whole.live_bytes_sized(small), whole.held_after_use_sized(small))),
                default=0)
    return max(0, mem.step_budget - glibc - kept_back(mem.step_budget, mem))


def on_demand_bound(mem: EngineMemory, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    manage: frozenset[str]) -> tuple[int, Callable[[], int] | None]:
    """(``device_budget``, what the device holds for every tensor of the step now) for a step
    kept on demand, where one arena holds them all (``StepContext.device_budget``,
    ``device_live``); (0, None) where nothing counts them.

    Why: a step on demand keeps its managed tensors within the budget less what the step
    started with, and cannot know what PyTorch will hold beside them. Its first update makes
    the optimizer's state, managed and kept while it fits that room, beside every gradient:
    an MLP of four 16 MiB weights with Adam, its state managed, held 272 MiB on its recording
    step under a step budget of 224 MiB. So such a step evicts managed tensors for PyTorch's
    bytes too, counted where they are counted: on a GPU, PyTorch's allocated bytes (ooc's
    swap-ins among them, ``arena="pytorch"``); on the CPU, the recycling allocator's live
    blocks (tensors from 1 MiB on: smaller ones it does not see) and the pool's used chunks,
    with what of the step's start it does not hold (``start_storages`` of every kind made
    while it was not PyTorch's: the weights built before the engine; managed state brought
    back between steps, 96 MiB under on an MLP after a refusal). A count taken as the
    difference from the step's start was wrong by what the step freed that was not its own
    (garbage collected mid-step: 96 MiB under on a Llama). Not over a fake driver, nor
    without ooc's CPU allocator."""
    device = device_budget(mem)
    if not device:
        return 0, None
    if not mem.on_cpu:
        where = mem.device
        real = where.type == "cuda" and torch.cuda.is_available()
        return (device, lambda: torch.cuda.memory_allocated(where)) if real else (0, None)
    if cpu_allocator.live_bytes() is None:
        return 0, None
    outside: list[tuple[weakref.ref, int]] | None = None   # (weakly: what the step lets go of goes)

    def live() -> int:
        nonlocal outside
        if outside is None:   # every kind, managed ones too: brought back between steps, glibc holds them
            held = [s for s in start_storages(model, optimizer, frozenset(), 0) if s.nbytes()]
            owned = cpu_allocator.owns([s.data_ptr() for s in held])
            outside = [(weakref.ref(s), s.data_ptr()) for s, mine in zip(held, owned) if not mine]
        return sum(s.nbytes() for r, at in outside if (s := r()) is not None and s.data_ptr() == at
                   ) + (cpu_allocator.live_bytes() or 0)   # (moved: swapped out, or into the pool, counted there)
    return device, live


def step_budget_for(room: int, mem: EngineMemory, *, held: bool = False) -> int:
    """The least step budget that gives the managed tensors ``room``: on the recording step,
    beside what the step starts with; ``held``, once a step was recorded whole, beside the most
    it holds beside them (``mem.step_held``, as ``managed_budget`` shares it)."""
    beside = mem.step_held if held else mem.step_start   # no budget under room + beside gives room
    return least_budget(lambda b: _room(b, mem, held), room, room + beside, mem.chunk)


def of_the_step(err: BudgetTooSmall, mem: EngineMemory, *, held: bool) -> BudgetTooSmall:
    """``err``, of the managed tensors' budget, said of the budget the user gave: the least
    step budget whose share holds ``err.minimum`` (``held``: once a step was recorded whole,
    beside what it holds; before that, beside what the step starts with)."""
    whole = BudgetTooSmall(function=err.function, name=err.name, working_set=err.working_set,
                           budget=mem.step_budget, minimum=step_budget_for(err.minimum, mem, held=held))
    beside = (f"beside the {format_size(mem.step_held)} the step recorded whole holds beside them" if held else
              f"beside the {format_size(mem.step_start)} the step starts with, not what its backward holds "
              "beside them, which the first step recorded whole names")
    whole.add_note(f"ooc: the budget covers the whole step (Options(budget_covers='step')): that minimum "
                   f"leaves {format_size(err.minimum)} for the managed tensors {beside}")
    return whole


class Update(NamedTuple):
    """What an update about to run adds to what a step recorded so far holds beside ooc's
    tensors (``update_so_far``): ``new``, the bytes of state it creates, there from the step's
    first op (the next step starts with them); ``read``, the variables of the gradients it
    reads, live until it reads them; ``during``, the most its own ops hold (0: not measured);
    ``ops``, how many it runs (the engine records each)."""

    new: int = 0
    read: tuple[int, ...] = ()
    during: int = 0
    ops: int = 0


def share_of(mem: EngineMemory, managed: VariableSequence, whole: VariableSequence, skipped: Any,
             update: Update = Update(), chunk: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(The managed tensors' share of ``mem.step_budget``, the bytes held beside them at each
    function) for a step recorded whole as ``whole`` with its managed tensors ``managed``:
    ``BudgetTooSmall`` where no share holds its working sets (``managed_budget``). Of a step
    recorded so far too, with what its ``update`` adds (``check_so_far``): one more figure, the
    most the update's ops hold, where it was measured. In ``chunk``s, if given (the pool's else)."""
    # the kinds managed by configuration: the state an update inside the backward made so far is
    # no variable of a step so far's managed recording yet
    held = tuple(h + update.new for h in held_beside(whole, managed, skipped, size=_size(mem), read_later=update.read,
                                                     min_bytes=mem.min_bytes, kinds=kinds_of(mem.manage)))
    held += (update.during,) if update.during else ()
    return managed_budget(managed, held, mem.step_budget, reserve=lambda b: kept_back(b, mem),
                          arenas=_arenas(mem), granule=chunk or mem.chunk, kept=lambda b: kept_words(b, mem)), held


def check_so_far(mem: EngineMemory, recording: Any, managed: VariableSequence, update: Update = Update(),
                 chunk: int | None = None) -> None:
    """``BudgetTooSmall`` where no share of ``mem.step_budget`` holds the working sets of the
    step recorded so far (``recording``: a recording step's ``StepRecording``, at its update;
    ``managed``: its managed tensors so far) beside what it holds, and what its update will
    hold (``update_so_far``), so that a budget the step proves too small is refused before the
    update (the step taken back), not at the step's end, once the update is applied. Sound:
    what the step so far holds beside its managed tensors at an op is at most what the whole
    step holds there (both at eager lifetimes; gradients and the state the update makes count
    as outliving the step only from the update on), the update's ops hold at most what the
    whole step's record of them holds (the same ops, on ``meta`` twins), and its working sets
    are the whole step's first ones, so the step's end would refuse that budget too. An update
    that does not run on ``meta`` (``dry_run``) is not measured: its temporaries are found at
    the step's end. In ``chunk``s, if given (``chunk_choice.ChunkChoice.at_update``)."""
    full = recording.full
    if full is not None:   # its gradients and the state made so far known as such (not temporaries)
        roles.mark_grads(full, recording.roles)
        so_far = full.sequence({}, roles.state_so_far(full, recording.roles, recording.ctx.optimizer), so_far=True)
        # (the functions at its first update: counted anew at each update inside the backward,
        # each refusal of a loop from a small budget named a little more, eight in a row)
        recording.functions_counted = recording.functions_counted or len(so_far.functions) + update.ops
        mem.step_records = max(mem.step_records, records_bytes(recording.functions_counted, mem.on_cpu))
        share_of(mem, managed, so_far, recording.skipped, update, chunk)


def update_so_far(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                  sizes: dict[torch.Tensor, tuple[int, ...]] | None, manage: frozenset[str], mem: EngineMemory,
                  recording: Any, measure: bool = True) -> Update:
    """What the update about to run adds to what a step recorded so far holds beside ooc's
    tensors, as the whole step's recording will count it (``Update``; ``sizes``:
    ``dry_run.state_sizes``, None: unknown), all less what ooc manages (from ``mem.min_bytes``
    on, of the kinds ``manage``d). ``during`` is measured on ``meta`` twins of the optimizer's
    tensors (``dry_run.update_held``) with the model's other weights and its buffers, there at
    every op; not (0) unless ``measure``."""
    size, full = _size(mem), recording.full
    new = sum(size(n) for p, each in (sizes or {}).items() if not optimizer.state.get(p)
              for n in each if not _managed("optimizer_state", n, manage, mem.min_bytes))
    if full is None:
        return Update(new)
    grads = (full.var(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    read = tuple(v for v in grads if v is not None   # (the recorded size: one on the tier has an empty storage now)
                 and not _managed("grads", full.nbytes[v], manage, mem.min_bytes))
    measured = update_held(optimizer, lambda kind, n: 0 if _managed(kind, n, manage, mem.min_bytes) else size(n)
                           ) if measure else None
    if measured is None:
        return Update(new, read)
    return Update(new, read, measured[0] + _others(optimizer, model, manage, mem), measured[1])


def _others(optimizer: torch.optim.Optimizer, model: torch.nn.Module, manage: frozenset[str],
            mem: EngineMemory) -> int:
    """Bytes of the model's weights the optimizer does not update and of its buffers, each
    storage once, less what ooc manages: beside the update at every op of it."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    size, seen, total = _size(mem), set(), 0
    others = [(p, "params") for p in model.parameters() if id(p) not in mine]
    for t, kind in others + [(b, None) for b in model.buffers()]:
        n = t.untyped_storage().nbytes() or t.numel() * t.element_size()   # on the tier: its own size
        key = t.untyped_storage()._cdata
        if key not in seen and not _managed(kind, n, manage, mem.min_bytes):
            seen.add(key)
            total += size(n)
    return total


def _size(mem: EngineMemory) -> Callable[[int], int]:
    """What a tensor of so many bytes takes on ``mem``'s device under a budget for the whole
    step (the CPU allocator's blocks then: whole pages)."""
    return functools.partial(cpu_allocator.block_bytes, pages=True) if mem.on_cpu else lambda n: n


def fit(mem: EngineMemory, managed: VariableSequence, whole: VariableSequence, skipped: Any) -> None:
    """The managed budget for ``mem.step_budget`` from the step recorded whole (``whole``) and
    its managed tensors (``managed``; ``skipped``: its ops the whole recording leaves out):
    the flat share, for a step without a plan, and, with one arena, what the step held beside
    them at each op, in ``managed``'s meta, which its plans are bounded by (``device_budget``).
    Beside the engine's records of its functions (``records_bytes``), the most any step counted."""
    mem.step_records = max(mem.step_records, records_bytes(len(whole.functions), mem.on_cpu))
    mem.budget, held = share_of(mem, managed, whole, skipped)
    mem.step_held = max(held)
    if device := device_budget(mem):   # shifted so that the least room is the share: a step off its plan has that
        shift = max(0, device - mem.step_held - mem.budget)
        managed.meta[HELD_BESIDE] = [h + shift for h in held]
    back = kept_back(mem.step_budget, mem)
    log.info("budget %s for the whole step: %s for the managed tensors (the step holds %s-%s beside them%s)",
             format_size(mem.step_budget), format_size(mem.budget), format_size(min(held)), format_size(max(held)),
             f", {format_size(back)} kept for the allocator's cache and the engine's records" if back else "")
