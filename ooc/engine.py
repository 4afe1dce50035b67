"""``OutOfCore``: train a model whose working memory exceeds a budget, bit for bit as in core."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import mmap
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import scheduler
from ooc.errors import OOCError, StorageError
from ooc.runtime import cpu_allocator, slots as sl
from ooc.runtime.composition import check_step_entry
from ooc.runtime.malloc import give_back_heap
from ooc.runtime.devices import cuda_runtime, make_pool, make_tier_and_pool
from ooc.runtime.dry_run import optimizer_need, state_sizes
from ooc.runtime.pool import DevicePool
from ooc.runtime.process_effects import ProcessEffects
from ooc.runtime.slots import Slot, State
from ooc.runtime.step_context import StepContext
from ooc.runtime.stepper import Stepper
from ooc.storage.tier import SlowerTier
from scheduler import on_demand
from scheduler.chunk_size import UNMANAGED_SHARE, choose_chunk, unmanaged_bytes
from scheduler.errors import BudgetTooSmall
from scheduler.ir import Kind
from scheduler.schedule import Schedule
from vmm.units import format_size, parse_size

log = logging.getLogger(__name__)

KINDS = ("activations", "params", "grads", "optimizer_state")
DEFAULT_CHUNK = 2 << 20   # the chunk a default engine starts with (the GPU's VMM granularity)
# The timeline keeps the events of this many recent steps (and at most 200,000 events), so
# that a long run's memory does not grow with its number of steps.
TIMELINE_STEPS = 32


class _Mode(TorchDispatchMode):
    """Routes every aten op of the step through the stepper."""

    def __init__(self, stepper: Stepper) -> None:
        super().__init__()
        self.stepper = stepper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.stepper.on_op(func, args, kwargs or {})


class OutOfCore:
    """Run training steps under a memory budget by swapping managed tensors to a slower tier.

    The first step records every aten op (forward, backward, optimizer) and the managed
    tensors each one touches, while keeping nothing resident that it does not need (slow,
    but within the budget). The recorded sequence goes to ``scheduler.plan``; the plan is
    proven safe by ``scheduler.check``; every later step executes exactly that plan, with
    transfers on background threads overlapping compute. A step that does something else
    (another batch shape, data-dependent control flow) is noticed at its first differing
    op, finished on demand, and re-planned. Swapping copies bytes: parameters come out
    bitwise identical to in-core training.

    Args:
        model: the ``nn.Module`` to train, on ``device``.
        optimizer: its optimizer. With ``params``/``grads``/``optimizer_state`` managed it is
            switched to its per-parameter implementation (``foreach=False``) so that one op
            never needs every parameter at once.
        budget: bytes (int) or a size string ("512MiB", "2GB") for the managed tensors.
        device: ``"cpu"`` (slower tier: a private swap file) or ``"cuda"`` (pinned host
            memory and copy streams; written against the driver API and tested against a fake
            driver in CI; run on an H100, see README).
        storage: directory in which a private 0700 swap directory is made (default: $TMPDIR).
        window: prefetch window in bytes or a size string (default: the scheduler's).
        chunk: physical chunk size of the device pool. Default: it adapts. The engine starts
            at 2 MiB (on the CPU, at most the budget rounded down to a power of two), and
            after its first recording step, if the activations it saved exceed the budget and
            those under half a chunk (left to PyTorch) take more than an eighth of it, it
            halves the chunk until they do not, down to the page size on the CPU (the VMM
            granularity, 2 MiB, on a GPU: there it warns instead), and records again
            (``scheduler/chunk_size.py``). Given explicitly (or with ``min_bytes``), it is
            fixed.
        manage: which tensors may leave the device: any of "activations" (saved for
            backward), "params", "grads", "optimizer_state". Default: activations.
        policy: the scheduler policy ("window" moves only what the budget forces out).
        verify: checksum swapped bytes and raise ``StorageError`` on corruption.
        min_bytes: tensors smaller than this stay with PyTorch (default: chunk / 2, and it
            adapts with the default chunk).

    Example::

        engine = ooc.OutOfCore(model, opt, budget="256MiB")
        for x, y in batches:
            with engine.step():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()   # or scaler.step(opt); the engine hooks the optimizer
    """

    tier: SlowerTier   # where swapped-out bytes live (FileTier on a CPU, PinnedTier on a GPU)
    pool: DevicePool   # the budget: device memory for swapped-in tensors
    #: The last step that ran unplanned (the recording step), whole, as ``ooc.trace``
    #: records a step: every storage, of every kind, with the same recorder
    #: (``ooc/record/``). None until one completed.
    last_recording: scheduler.VariableSequence | None = None

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 budget: int | str, device: str | torch.device = "cpu", storage: str | None = None,
                 window: int | str | None = None, chunk: int | str | None = None,
                 manage: tuple[str, ...] | list[str] | str = ("activations",), policy: str = "window",
                 verify: bool = False, min_bytes: int | str | None = None, threads: int = 2) -> None:
        self.budget = parse_size(budget, what="budget")
        # With neither chunk nor min_bytes given, the chunk adapts to what the first
        # recording step saves (_adapt_chunk); either one given keeps both as before.
        self._adapt_pending = chunk is None and min_bytes is None
        self._adaptive = self._adapt_pending
        self.chunk = DEFAULT_CHUNK if chunk is None else parse_size(chunk, what="chunk")
        self.window = None if window is None else parse_size(window, what="window")
        min_bytes = None if min_bytes is None else parse_size(min_bytes, what="min_bytes")
        manage = (manage,) if isinstance(manage, str) else tuple(manage)
        unknown = [m for m in manage if m not in KINDS]
        if unknown:
            raise OOCError(f"manage: unknown kind(s) {unknown}; choose from {list(KINDS)}")
        self.manage = frozenset(manage)
        if policy not in scheduler.POLICIES:
            raise OOCError(f"policy {policy!r} is not one of {list(scheduler.POLICIES)}")
        self.policy = policy
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise OOCError(f"device {self.device}: the runtime runs on 'cpu' or 'cuda'")
        # torch.cuda through one seam (ooc.runtime.devices.CudaRuntime): ooc.testing.fake_cuda()
        # swaps it to run this CUDA path over a fake driver, with the model on the CPU.
        cuda = cuda_runtime() if self.device.type == "cuda" else None
        if cuda is not None and not cuda.is_available():
            raise OOCError(f"device {self.device}: this PyTorch has no usable CUDA (torch "
                           f"{torch.__version__}); install a CUDA build and 'ooc[cuda]', or use device='cpu'")
        if cuda is not None and self.device.index is None:
            # Parameters say "cuda:0", never "cuda": compare (and allocate) with the index.
            self.device = torch.device("cuda", cuda.current_device())
        if self._adaptive and self.device.type == "cpu":
            self.chunk = _start_chunk(self.budget)   # a budget under 2 MiB starts smaller
        if self.budget < self.chunk:
            raise OOCError(f"budget {format_size(self.budget)} is smaller than one chunk "
                           f"({format_size(self.chunk)}); raise the budget or lower chunk")
        self.min_bytes = self.chunk // 2 if min_bytes is None else min_bytes
        home = cuda.tensor_device(self.device) if cuda is not None else self.device
        for name, p in itertools.chain(model.named_parameters(), model.named_buffers()):
            if p.device != home:
                raise OOCError(f"{name} is on {p.device}, but the engine manages {home}: "
                               f"move the model with model.to('{home}') first")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise OOCError(f"threads must be a positive int (I/O threads of the swap tier), got {threads!r}")
        self.model, self.optimizer = model, optimizer
        per_parameter = optimizer is not None and bool(self.manage & {"params", "grads", "optimizer_state"})
        if per_parameter and any(group.get("fused") for group in optimizer.param_groups):
            raise OOCError("a fused optimizer updates every parameter in one op; "
                           "create it with fused=False to manage params/grads/state")
        # What the steps change outside the engine (PyTorch's CPU allocator, glibc's mmap
        # threshold, the optimizer's foreach flag): made at the first step, undone by close()
        # or when the engine is collected (ooc/runtime/process_effects.py). Until then the
        # pool gives back nothing on its own (``pool_excess``, set by the first step).
        self.pool_excess = None
        self._effects = ProcessEffects(self.device.type, optimizer, per_parameter)
        # CPU: a swap file and a memfd pool; CUDA: pinned host memory and a VMM pool. The pool
        # checks the chunk against the backend's granularity before anything else is made.
        self.tier, self.pool = make_tier_and_pool(self.device, self.budget, self.chunk, storage,
                                                  threads, verify)
        self._ids = itertools.count()
        self.persistent: dict[int, Slot] = {}
        # A plan holds for the state a step starts in: which parameters, grads and optimizer
        # state exist. Gradient accumulation alternates two such states, so plans are kept
        # per starting state (``_start_key``) instead of one.
        self.plans: dict[tuple[frozenset[int], tuple[bool, ...]],
                         tuple[Schedule, dict[tuple[int, int], int]]] = {}
        self.plan_runs: dict[int, int] = {}
        self.schedule: Schedule | None = None
        self.binding: dict[tuple[int, int], int] = {}
        self.counters: Counter = Counter()
        self.last: dict[str, Any] = {}
        self.events: list[tuple[str, str, float, float, int]] = []
        self._stepper: Stepper | None = None
        self._hooks: list = []
        self._closed = False
        self._optimizer_stepped = False   # the optimizer's state exists (its size is known)
        # Before it does: the bytes of each parameter's state after one update, measured on
        # meta twins by the recording step (``dry_run.state_sizes``); None if not measurable.
        self._state_sizes: dict[torch.Tensor, tuple[int, ...]] | None = None
        self._between: dict[int, int] = {}   # var -> tensor version at the end of the last step
        # A persistent tensor's name -> its variable id, and back (``_stable_vars``).
        self._canon: dict[tuple[Kind, str], int] = {}
        self._canon_name: dict[int, tuple[Kind, str]] = {}
        if "params" in self.manage:
            for name, p in model.named_parameters():
                self._adopt(p, Kind.PARAM, name)
        if "grads" in self.manage:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        if "optimizer_state" in self.manage and optimizer is not None:
            self._hooks.append(optimizer.register_load_state_dict_post_hook(self._state_loaded))
        self._warned_released = False
        if self.manage & {"params", "grads", "optimizer_state"}:
            self._hooks += [model.register_state_dict_pre_hook(self._bring_back_hook),
                            model.register_load_state_dict_pre_hook(self._bring_back_hook)]
            if optimizer is not None:
                self._hooks.append(optimizer.register_state_dict_pre_hook(self._bring_back_hook))
        if optimizer is not None:   # the update starts at optimizer.step(), however it is called
            # Held weakly: an engine that manages activations only keeps nothing between steps,
            # so a user who drops it without close() loses nothing, and it can be collected
            # while model and optimizer live on. One that manages persistent tensors owns their
            # swapped bytes between steps: the model's hooks above keep it alive with the model.
            self._hooks += [optimizer.register_step_pre_hook(_weakly(self._update_starts)),
                            optimizer.register_step_post_hook(_weakly(self._update_done))]
        # Collected without close(): unhook, and put back what the steps changed outside.
        # (``_held`` follows the pool when the chunk changes; it references nothing that refers
        # to the engine, or the engine could never be collected.)
        self._held = _Held(self.tier, self.pool)
        weakref.finalize(self, _collected, self._hooks, self._effects, self._held)

    # -- persistent tensors ------------------------------------------------------------------

    def new_var(self) -> int:
        return next(self._ids)

    def _adopt(self, t: torch.Tensor, kind: Kind, name: str) -> Slot | None:
        s = t.untyped_storage()
        for slot in self.persistent.values():
            if slot.storage is s:
                return slot
        if s.nbytes() < self.min_bytes:
            return None
        slot = Slot(self.new_var(), kind, s.nbytes(), name, in_place=True,
                    state=State.RESIDENT, storage=s)
        self.persistent[slot.var] = slot
        return slot

    def _state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.load_state_dict`` put new tensors in its state: manage those instead of
        the ones it replaced (whose tier copies go), from the next step on, which re-plans."""
        for var, slot in list(self.persistent.items()):
            if slot.kind is Kind.OPTIMIZER_STATE:
                if slot.host_current:
                    self.tier.discard(slot.key)
                    slot.host_current = False
                del self.persistent[var]
        names = {p: n for n, p in self.model.named_parameters()}
        for p, state in optimizer.state.items():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    if not t.untyped_storage().resizable():   # torch.load's: cannot be released
                        t = state[key] = t.clone()
                    self._adopt(t, Kind.OPTIMIZER_STATE, f"{names.get(p, '?')}.{key}")

    def _grad_hook(self, name: str):
        # A parameter's hooks are held from C++, where the garbage collector cannot follow
        # them: a hook that held the engine would keep it, and with it the model, forever.
        # The model's state_dict hooks (Python) keep the engine alive while the model lives.
        engine = weakref.ref(self)

        def hook(p: torch.nn.Parameter) -> None:
            e = engine()
            st = None if e is None else e._stepper
            if st is None or p.grad is None:
                return
            with _disable_current_modes():
                st.adopt_grad_of(p.grad, name)
        return hook

    # -- the step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step. The first records and plans; later ones execute the plan.

        The update is ``optimizer.step()`` wherever it is called inside the step (directly,
        by ``GradScaler.step``, or by ``optimizer_step()``); a step without one (a micro-batch
        of gradient accumulation, an update the scaler skipped) is a step too.

        A step that raises before its update (an exception in the user's code, a
        swap failure, Ctrl-C) is rolled back as it unwinds: its transfers are waited for, the
        buffers it touched get their old bytes, the gradients it created are dropped, and
        the same exception reaches the caller. The next step runs as if it had not happened.
        What is and is not guaranteed, test by test: GUARANTEES.md.
        """
        if self._closed:
            raise OOCError("this engine is closed; create a new OutOfCore")
        if self._stepper is not None:
            raise OOCError("engine.step() is already active; steps do not nest")
        check_step_entry(_Mode, "activations" in self.manage)
        if not self._effects.applied:   # the first step (see ProcessEffects)
            self.pool_excess = self._effects.apply()
        t0 = time.perf_counter()
        self._forget_dropped()
        self._stable_vars()
        key = self._start_key()
        self.schedule, self.binding = self.plans.get(key, (None, {}))
        if self.schedule is not None:   # how often this plan ran before (see Stepper._diverge)
            self.plan_runs[id(self.schedule)] = self.plan_runs.get(id(self.schedule), -1) + 1
        self._reconcile()
        st = Stepper(self._step_context(key), self.schedule, self.binding,
                     observe_small=self._adapt_pending)
        if self.device.type == "cpu":
            cpu_allocator.begin(self, _recycle_bytes(self.budget), _cache_cap(self.budget))
        self._stepper = st
        try:
            with contextlib.ExitStack() as stack:
                if "activations" in self.manage:
                    stack.enter_context(st.saved_tensors_hooks())
                stack.enter_context(_Mode(st))
                yield
        except BaseException as exc:   # the user's code, a swap failure, Ctrl-C: roll back, re-raise
            self._stepper = None
            self._finish(st, exc, time.perf_counter() - t0)
            if (st.updating and isinstance(exc, StorageError)
                    and self.manage & {"params", "optimizer_state"}):
                err = StorageError(
                    f"{exc}. This happened during the optimizer step, which swaps managed parameters "
                    "and state: parameters it had already updated keep their new values, the others "
                    "their old ones. Restore model and optimizer from a checkpoint before training on")
                err.errno = exc.errno
                raise err from exc
            raise
        self._stepper = None
        self._finish(st, None, time.perf_counter() - t0)

    def _step_context(self, key: Any) -> StepContext:
        """What the step that starts now needs from the engine (``ooc/runtime/step_context.py``)."""
        runs = self.plan_runs.get(id(self.schedule), 0) if self.schedule is not None else 0
        return StepContext(budget=self.budget, chunk=self.chunk, min_bytes=self.min_bytes,
                           manage=self.manage, device=self.device, tier=self.tier, pool=self.pool,
                           new_var=self._ids.__next__, counters=self.counters, model=self.model,
                           optimizer=self.optimizer, persistent=tuple(self.persistent.values()),
                           plan_runs=runs, pool_excess=self.pool_excess, start_key=key)

    def _forget_dropped(self) -> None:
        """Stop managing the gradients and optimizer state that the model and the optimizer
        let go of between steps (``zero_grad()`` before the step, ``opt.state.clear()``): the
        engine's reference would keep their bytes, and the tier their copies, for nothing;
        and the next step's plan would count tensors that no longer exist."""
        held = {id(t.untyped_storage()) for t in self._persistent_tensors()}
        for var, slot in list(self.persistent.items()):
            if slot.kind is Kind.PARAM or slot.storage is None or id(slot.storage) in held:
                continue
            if slot.host_current:
                self.tier.discard(slot.key)
                slot.host_current = False
            slot.storage = None
            del self.persistent[var]
            self._between.pop(var, None)

    def _stable_vars(self) -> None:
        """Give each persistent tensor the variable id its name had when first managed.

        A gradient set to None and created again in the step (``zero_grad()`` at the top of
        the loop, inside the step, with grads managed) is a new variable at the step's end;
        with a fresh id each time, no step ever started in a state a plan was made for, and
        every step ran on demand and re-planned. Plans are keyed by these ids
        (``_start_key``), so the same tensors under the same names must keep their ids."""
        taken = set(self.persistent)
        renamed: dict[int, Slot] = {}
        for var, slot in self.persistent.items():
            name = (slot.kind, slot.name)
            canon = self._canon.get(name)
            if canon is None and var not in self._canon_name:   # one id per name, one name per id
                self._canon[name], self._canon_name[var] = var, name
                canon = var
            if canon is not None and canon != var and canon not in taken:   # never two slots with one id
                taken.discard(var)
                taken.add(canon)
                if var in self._between:
                    self._between[canon] = self._between.pop(var)
                slot.var = canon
            renamed[slot.var] = slot
        self.persistent = renamed

    def _start_key(self) -> tuple[frozenset[int], tuple[bool, ...]]:
        """The state a step starts in, which decides its ops: the managed persistent tensors,
        and which parameters have a gradient. Autograd creates a missing gradient (a detach)
        and adds to an existing one (``add_``): the first micro-batch of an accumulation
        window and the others run different ops. With grads unmanaged (the default) no
        persistent variable says which, and the two kinds of step replaced each other's plan
        at every step. (A step that also calls ``optimizer_step()`` extends the plan of its
        starting state: it diverges once at the plan's end, and the steps without an update
        run the longer plan's prefix.)"""
        return frozenset(self.persistent), tuple(p.grad is not None for p in self.model.parameters())

    def optimizer_step(self) -> None:
        """``optimizer.step()`` then ``zero_grad(set_to_none=True)``, inside the managed step.

        A convenience: ``optimizer.step()`` (or ``scaler.step(optimizer)``) inside
        ``with engine.step():`` is recognised as the update by itself (see ``_update_starts``).
        """
        if self.optimizer is None:
            raise OOCError("this engine was created without an optimizer")
        if self._stepper is None:
            raise OOCError("call engine.optimizer_step() inside `with engine.step():`")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _update_starts(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``optimizer.step()`` pre-hook: the update starts here, whoever calls it (the user,
        ``GradScaler.step``, which skips it when the gradients are not finite, or
        ``optimizer_step()``).

        In the recording step it first checks that the budget is feasible, so that a budget
        that is too small fails before any parameter changes. Then, the commit point: every
        transfer still in flight is waited for (a failed one raises here) and the room the
        update will write is reserved on the swap file (a full disk raises here), so that
        neither failure can stop the update halfway. From here on the step is not rolled back.

        Outside ``engine.step()`` the update is plain PyTorch: managed tensors on the tier are
        brought back first (an empty storage read there is garbage or a segfault), and the
        next step sees the update's writes as writes between steps.
        """
        st = self._stepper
        if st is None:
            self._bring_back_hook()
            return
        # The backward is over: its last node returned, so the activations it unpacked are no
        # longer held by autograd (on demand, their bytes go back before the update needs room).
        st.close_node()
        if st.schedule is None:
            self._check_feasible(st)
            overflow = st.forgive_overflow()
            if overflow is not None:   # feasible with a plan: only the unplanned step overflowed
                log.warning("the recording step went over the pool once (%s); planned steps stay "
                            "within the budget", overflow)
        self._commit_point(st)
        st.update_starts()   # from here on the step is not rolled back

    def _update_done(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``optimizer.step()`` post-hook: the update completed (its state exists, with its
        size). Outside a step, the state it created there becomes managed too."""
        self._optimizer_stepped = True
        st = self._stepper
        if st is not None:
            st.update_done()
        elif "optimizer_state" in self.manage:
            names = {p: n for n, p in self.model.named_parameters()}
            for p, state in optimizer.state.items():
                for key, t in state.items():
                    if isinstance(t, torch.Tensor):
                        self._adopt(t, Kind.OPTIMIZER_STATE, f"{names.get(p, '?')}.{key}")

    def _commit_point(self, st: Stepper) -> None:
        """Make sure nothing the step did so far can fail once parameters start changing.

        Waits for every transfer in flight: a failed one raises here, naming its variable,
        while model and optimizer are still as before the step (the step is rolled back).
        Then reserves on the tier the room that the updated parameters and optimizer state
        may need, so that a full disk fails here and not halfway through the update.
        """
        st.wait_for_transfers()
        self.tier.reserve(self._writes_ahead(st))

    def _writes_ahead(self, st: Stepper) -> list[tuple[int | None, int]]:
        """(tier key, or None for a new one; bytes) of each managed tensor the optimizer step
        may write to the tier: the updated parameters and the optimizer state."""
        out: list[tuple[int | None, int]] = []
        if not self.manage & {"params", "optimizer_state"}:
            return out
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                slot = st.slot_of(p)
                if "params" in self.manage and slot is not None:
                    out.append((slot.key, slot.nbytes))
                if "optimizer_state" not in self.manage:
                    continue
                state = [t for t in self.optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
                for t in state:
                    s = st.slot_of(t)
                    if s is not None:
                        out.append((s.key, s.nbytes))
                if not state and not self._optimizer_stepped:   # created now: as measured
                    out += [(None, n) for n in (self._state_sizes or {}).get(p, ()) if n >= self.min_bytes]
        return out

    def _check_feasible(self, st: Stepper) -> None:
        """Plan what was recorded so far (forward, backward), then measure what the update
        will need: the first one runs on demand and must find room, op by op, for every
        managed tensor and every new storage of the optimizer that the op touches. It is
        measured by running ``step()`` on meta twins (``ooc/runtime/dry_run.py``), from
        shapes: here the parameters and grads are on the tier, their storages empty (sizes
        read from them said 0 bytes, and an overflowing update got through)."""
        seq = st.rec.sequence({})
        scheduler.plan(seq, budget=self.budget, window=self.window, policy=self.policy)
        if "optimizer_state" in self.manage and not self._optimizer_stepped:
            self._state_sizes = state_sizes(self.optimizer)   # what the first update creates
        counted = self.manage & {"params", "grads", "optimizer_state"}
        if not counted:
            return
        names = {p: n for n, p in self.model.named_parameters()}
        need = optimizer_need(self.optimizer, names, counted, self.min_bytes, len(st.rec.names))
        if need is not None and need.nbytes > self.budget:
            raise BudgetTooSmall(function=need.index,
                                 name=f"{need.name} of the optimizer step, holding {', '.join(need.tensors)}",
                                 working_set=need.nbytes, budget=self.budget, minimum=need.nbytes)

    def _reconcile(self) -> None:
        """Bring persistent tensors to where the plan expects them at the start of a step;
        with no plan for this start (a step on demand), within the budget."""
        self._note_writes_between()
        try:
            if self.schedule is None:
                self._fit_persistent()
                return
            want = self.schedule.initial_resident
            for slot in self.persistent.values():
                if slot.var in want and slot.state is State.HOST:
                    sl.start_swap_in(slot, self.tier, self.pool)
                    sl.finish_swap_in(slot)
                    self.counters["bytes_in"] += slot.nbytes
                elif slot.var not in want and slot.state is State.RESIDENT:
                    self._to_tier(slot)
        except BaseException:
            self._settle(self.persistent.values())   # nothing changed yet: every slot consistent
            raise

    def _fit_persistent(self) -> None:
        """Before a step on demand, move resident persistent tensors to the tier until the rest
        fits the budget: the whole model is resident before the first step, the optimizer
        state the first update created may be after it. Which ones go is the scheduler's
        choice (``scheduler.on_demand.persistent_to_evict``); the step evicts the rest as
        needed."""
        resident = [(s, s.nbytes) for s in self.persistent.values() if s.state is State.RESIDENT]
        for slot in on_demand.persistent_to_evict(resident, self.budget):
            self._to_tier(slot)

    def _to_tier(self, slot: Slot) -> None:
        """Give a resident persistent slot's memory back, writing it out first if needed."""
        if slot.host_current:
            sl.release(slot)
        else:
            sl.start_swap_out(slot, self.tier)
            sl.finish_swap_out(slot)
            self.counters["bytes_out"] += slot.nbytes
        slot.state = State.HOST

    def _settle(self, slots) -> list[BaseException]:
        """Wait for the transfers of ``slots``; leave each resident or on the tier. Returns the
        transfers' errors; a KeyboardInterrupt during the wait is raised once all are done."""
        errors: list[BaseException] = []
        interrupt: BaseException | None = None
        for slot in list(slots):
            try:
                e = sl.settle(slot, self.tier)
            except BaseException as exc:  # noqa: B036 - an interrupt: re-raised below
                interrupt = interrupt or exc
                continue
            if e is not None:
                errors.append(e)
        if interrupt is not None:
            raise interrupt
        return errors

    def _finish(self, st: Stepper, exc: BaseException | None, seconds: float) -> None:
        """Drain transfers, keep what outlives the step, and re-plan if the step was not planned.

        A step that failed before its optimizer step (``exc``: the user's exception, a swap
        failure, Ctrl-C; or a transfer that fails here) is rolled back: the buffers it wrote
        (BatchNorm statistics) get their old bytes, the gradients it created are dropped, and
        every managed tensor is left either in memory or on the tier, so the next step can
        run as if this one had not.
        """
        st.close_node()
        if self.device.type == "cpu":
            cpu_allocator.end(self)   # the cache stays for the next step, shrinking between
        interrupt: BaseException | None = None
        try:   # every transfer, also one whose future an interrupt kept from reaching its
            # slot; first, so that settling the slots below finds them complete (on a GPU: one
            # host synchronization for the step's end, not one per slot)
            self.tier.drain()
        except BaseException as e:  # noqa: B036 - raised at the end
            interrupt = e
        try:
            errors = self._settle(st.slots.values())
        except BaseException as e:  # noqa: B036 - every slot is settled; raised at the end
            interrupt, errors = interrupt or e, []
        st.writes_settled()
        failed = exc is not None or bool(errors) or interrupt is not None
        if failed and st.rec.optimizer_start is None:
            note = st.roll_back()
            if note and exc is not None and hasattr(exc, "add_note"):
                exc.add_note(note)
        live = self._live_out(st)
        st.hand_back(live)
        for var, slot in list(self.persistent.items()):
            if var not in live:
                del self.persistent[var]
        for var, slot in live.items():
            self.persistent[var] = slot
        st.mark_live_out(live)
        for slot in st.slots.values():
            if slot.host_current and slot.var not in live:   # activations, dropped grads
                self.tier.discard(slot.key)
                slot.host_current = False
            if not slot.in_place:
                slot.storage = None
        back_error: BaseException | None = None
        try:
            self._step_end_bring_back()
        except Exception as e:  # a failed read: the tensor stays on the tier; raised below
            back_error = e
        if self.device.type == "cpu" and self.pool_excess is None:
            # no allocator bounds the pool's idle chunks: drop them. A GPU pool keeps its
            # chunks mapped between steps (within the budget): unmapping synchronizes the
            # device, and the next step would map them again.
            self.pool.trim()
        if self.device.type == "cpu":
            give_back_heap()   # parameters built before the engine left their pages in glibc's heap
        self.counters["steps"] += 1
        for tr, name, t0, t1 in st.events:
            self.events.append((tr, name, t0, t1, self.counters["steps"]))
        oldest = self.counters["steps"] - TIMELINE_STEPS
        del self.events[:bisect.bisect_right(self.events, oldest, key=lambda ev: ev[4])]
        del self.events[:-200_000]
        self.last = {"step_s": seconds, "stall_s": st.stall_s, "planned": st.planned,
                     "diverged_at": st.diverged_at, "resident_peak_bytes": st.peak}
        if interrupt is not None:
            raise interrupt
        if exc is not None:
            if back_error is not None and hasattr(exc, "add_note"):
                exc.add_note(f"ooc: reading managed tensors back after it failed too: {back_error}")
            return   # step() re-raises it; the transfers' errors are its consequences
        if errors:
            err = errors[0]
            if st.rec.optimizer_start is not None:
                err = StorageError(f"{err}. The step's update had completed and nothing was lost: "
                                   "a tensor whose write failed kept its bytes in memory")
                err.errno = errors[0].errno
            raise err
        if back_error is not None:   # the step is done; a tensor the tier holds could not come back
            raise back_error
        recording = st.whole_recording()
        if recording is not None:
            self.last_recording = recording
        if st.schedule is None or st.diverged_at is not None:
            st.book_device_times()
            if self._adapt_chunk(st):
                overflow = st.forgive_overflow()
                if overflow is not None:   # the next step records again, in the new chunks
                    log.warning("the recording step went over the pool once (%s); the next step "
                                "records again with %s chunks", overflow, format_size(self.chunk))
            else:
                self._replan(st)
        if st.overflow is not None:   # an on-demand step needed more than the pool could give
            raise st.overflow

    def _live_out(self, st: Stepper) -> dict[int, Slot]:
        """The managed tensors that exist after the step: parameters, kept grads, state."""
        live: dict[int, Slot] = {}
        if not self.manage & {"params", "grads", "optimizer_state"}:
            return live   # activations only: none outlives the step
        by_storage = {id(s.storage): s for s in [*self.persistent.values(), *st.slots.values()]
                      if s.in_place and s.storage is not None}
        candidates: list[tuple[torch.Tensor, Kind, str]] = []
        names = {p: n for n, p in self.model.named_parameters()}
        for p, name in names.items():
            if "params" in self.manage:
                candidates.append((p, Kind.PARAM, name))
            if "grads" in self.manage and p.grad is not None:
                candidates.append((p.grad, Kind.GRAD, f"{name}.grad"))
            if "optimizer_state" in self.manage and self.optimizer is not None:
                for key, t in self.optimizer.state.get(p, {}).items():
                    if isinstance(t, torch.Tensor):
                        candidates.append((t, Kind.OPTIMIZER_STATE, f"{name}.{key}"))
        for t, kind, name in candidates:
            s = t.untyped_storage()
            slot = by_storage.get(id(s))
            if slot is None:
                slot = st.live_slot(s, kind, name)
                if slot is None:
                    continue
                by_storage[id(s)] = slot
            elif slot.name != name and slot.var not in self.persistent:
                st.rename(slot, name)   # optimizer state written out on demand before it had a name
            live[slot.var] = slot
        return live

    def _adapt_chunk(self, st: Stepper) -> bool:
        """With the default chunk, after the first recording step that completes: choose the
        chunk (and threshold, half a chunk) from the sizes it saved and the budget
        (``scheduler.chunk_size.choose_chunk``). A smaller chunk gives a new pool, and the
        next step records again (this one's sequence leaves out the tensors now managed).
        Returns whether the chunk changed. Decided once; ``set_budget`` asks again."""
        saved = st.saved_sizes()
        if not self._adapt_pending or saved is None:
            return False
        self._adapt_pending = False
        floor = self.pool.granularity   # the page; on a GPU, the VMM granularity
        chunk = choose_chunk(saved, self.budget, self.chunk, floor)
        left = unmanaged_bytes(saved, chunk // 2)
        if sum(saved) > self.budget and left > self.budget // UNMANAGED_SHARE:
            log.warning("saved activations in tensors under %s take %s, more than an eighth of the "
                        "%s budget, and stay outside it: the chunk cannot go below %s, the %s "
                        "granularity. Pass min_bytes= to manage smaller tensors (each takes a whole "
                        "chunk of the budget)", format_size(chunk // 2), format_size(left),
                        format_size(self.budget), format_size(floor), self.device.type)
        if chunk == self.chunk:
            return False
        log.info("chunk %s -> %s (tensors from %s managed): saved activations under %s took %s of "
                 "the %s budget; the next step records again", format_size(self.chunk),
                 format_size(chunk), format_size(chunk // 2), format_size(self.min_bytes),
                 format_size(unmanaged_bytes(saved, self.min_bytes)), format_size(self.budget))
        self._set_chunk(chunk, chunk // 2)
        return True

    def _set_chunk(self, chunk: int, min_bytes: int) -> None:
        """Manage tensors from ``min_bytes`` on, in a new pool of ``chunk``-sized chunks sized
        to the budget; the plans made before go. Between steps only: no activation holds a
        pool range then (parameters, grads and state are resized in place, never in it)."""
        self.chunk, self.min_bytes = chunk, min_bytes
        self.pool.trim()   # the old pool's idle chunks: nothing will reuse them
        old, self.pool = self.pool, make_pool(self.device, self.budget, chunk)
        self._held.pool = self.pool
        _close_pool(old)
        self.plans.clear()
        self.schedule = None
        self.binding = {}
        if "params" in self.manage:   # parameters now above the threshold are managed too
            for name, p in self.model.named_parameters():
                self._adopt(p, Kind.PARAM, name)

    def _replan(self, st: Stepper) -> None:
        seq = st.rec.sequence({"policy": self.policy, "chunk": self.chunk})
        seq = _round_activations(seq, self.chunk)
        t0 = time.perf_counter()
        schedule = scheduler.plan(seq, budget=self.budget, window=self.window, policy=self.policy)
        scheduler.check(schedule)
        self.schedule = schedule
        self.binding = {where: var for var, where in st.rec.born_at.items()}
        self.plans[st.start_key] = (self.schedule, self.binding)
        self.counters["plans"] += 1
        log.info("planned %d ops in %.3fs: %s in, %s out per step", len(seq.functions),
                 time.perf_counter() - t0, format_size(schedule.bytes_in), format_size(schedule.bytes_out))

    # -- outside the step --------------------------------------------------------------------

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Bring every managed parameter, grad and state tensor back, e.g. to evaluate or save.

        Needed only when the managed params, grads and state together exceed the budget:
        otherwise every step's end already brought them back (see ``_step_end_bring_back``),
        and ``state_dict()``/``load_state_dict()`` of the model and the optimizer bring them
        back by themselves in any case. The next step puts them where its plan wants them.
        """
        self._bring_back()
        yield

    def _step_end_bring_back(self) -> None:
        """At a step's end, bring the managed persistent tensors back if all of them fit the
        budget: between steps a released storage has 0 bytes under a tensor that still has
        its shape, and PyTorch does not check that on a read (``torch.save`` wrote empty
        storages, ``p.sum()`` read freed memory: a segfault), and no hook can catch an
        arbitrary read of a plain tensor. Within the budget this costs no memory the budget
        did not grant. A model whose params, grads and state exceed the budget (the reason to
        manage them) keeps them on the tier between steps: ``state_dict()`` and
        ``load_state_dict()`` bring them back through hooks, other reads need
        ``with engine.resident():`` (README)."""
        total = sum(s.nbytes for s in self.persistent.values())
        if total <= self.budget:
            self._bring_back(between_steps=False)
            return
        if not self._warned_released and any(s.state is State.HOST for s in self.persistent.values()):
            self._warned_released = True
            log.warning("managed params/grads/optimizer state (%s) exceed the %s budget: between "
                        "steps they stay on the slower tier; state_dict()/load_state_dict() bring "
                        "them back, other reads need `with engine.resident():`",
                        format_size(total), format_size(self.budget))
        self._between = self._versions()

    def _bring_back(self, *, between_steps: bool = True) -> None:
        """Read every managed persistent tensor the tier holds back into its storage (the
        tier's copies stay current: the next step lets go of them again without writing,
        unless they were written in between)."""
        if between_steps:   # a step's own writes are the stepper's to track
            self._note_writes_between()   # before the versions are taken again below
        try:
            for slot in self.persistent.values():
                if slot.state is State.HOST:
                    sl.start_swap_in(slot, self.tier, self.pool)
                    sl.finish_swap_in(slot)
                    self.counters["bytes_in"] += slot.nbytes
        except BaseException:
            self._settle(self.persistent.values())
            raise
        self._between = self._versions()

    def _bring_back_hook(self, *args: Any, **kwargs: Any) -> None:
        """``state_dict()``/``load_state_dict()`` pre-hook: their reads and copies need the
        bytes (inside a step the stepper brings each tensor back at its use)."""
        if self._stepper is None and not self._closed:
            self._bring_back()

    def _note_writes_between(self) -> None:
        """A persistent tensor written between steps (load_state_dict's copy_, an in-place
        edit) has a stale copy on the tier: forget it, since releasing the bytes without
        writing them would lose the write. Runs before anything records new versions."""
        for var, version in self._versions().items():
            slot = self.persistent[var]
            if (slot.state is State.RESIDENT and slot.host_current
                    and self._between.get(var) != version):
                self.tier.discard(slot.key)
                slot.host_current = False

    def _versions(self) -> dict[int, int]:
        """The version counter of the tensor that holds each persistent variable (params,
        their grads, optimizer state): in-place writes between steps bump it."""
        if not self.persistent:   # activations only: nothing to look for (twice a step)
            return {}
        by_storage = {id(s.storage): s for s in self.persistent.values() if s.storage is not None}
        out: dict[int, int] = {}
        for t in self._persistent_tensors():
            slot = by_storage.get(id(t.untyped_storage()))
            if slot is not None and slot.storage is t.untyped_storage():
                out[slot.var] = t._version
        return out

    def _persistent_tensors(self) -> list[torch.Tensor]:
        """The tensors the model and the optimizer hold now: parameters, their grads, state
        (of every parameter the optimizer has state for)."""
        tensors = []
        for p in self.model.parameters():
            tensors += [p, p.grad] if p.grad is not None else [p]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return tensors

    def stats(self) -> dict[str, int | float]:
        """Flat numbers with stable keys, like ``torch.cuda.memory_stats()``: what moved, what
        stalled, what the plan says. Every key is there from the start (0 before the first
        step; ``last_diverged_at`` is -1 when the last step kept to its plan). The keys are
        listed in README ("Statistics"); ``tier.*`` are the slower tier's own counters (its
        numbers only; its settings are its attributes)."""
        last = self.last
        diverged = last.get("diverged_at")
        plan = self.schedule.summary() if self.schedule is not None else {}
        out: dict[str, int | float] = {
            "steps": self.counters["steps"],
            "plans": self.counters["plans"],
            "bytes_in": self.counters["bytes_in"],
            "bytes_out": self.counters["bytes_out"],
            "budget": self.budget,
            "chunk": self.chunk,
            "last_step_s": last.get("step_s") or 0.0,
            "last_stall_s": last.get("stall_s") or 0.0,
            "last_planned": int(bool(last.get("planned"))),
            "last_diverged_at": -1 if diverged is None else diverged,
            "resident_peak_bytes": last.get("resident_peak_bytes") or 0,
            "pool_peak_mapped_bytes": self.pool.stats().get("peak_mapped_bytes") or 0,
        }
        for key in PLAN_STAT_KEYS:
            out[f"plan.{key}"] = plan.get(key) or 0
        out.update(_numbers("tier", self.tier.stats()))
        allocator = cpu_allocator.stats() if self.device.type == "cpu" else None
        for key in cpu_allocator.STAT_KEYS:
            out[f"cpu_allocator.{key}"] = (allocator or {}).get(key, 0)
        return out

    def set_budget(self, budget: int | str) -> None:
        """Change the budget; the next step records again and re-plans under it. With the
        default chunk, that step also chooses the chunk again (never a larger one)."""
        new = parse_size(budget, what="budget")
        chunk = self.chunk
        if self._adaptive and self.device.type == "cpu":
            chunk = min(chunk, _start_chunk(new))
        if new < chunk:
            raise OOCError(f"budget {format_size(new)} is smaller than one chunk ({format_size(chunk)})")
        with self.resident():
            pass
        self.budget = new
        self._adapt_pending = self._adaptive
        self._set_chunk(chunk, chunk // 2 if self._adaptive else self.min_bytes)

    def timeline(self, path: str) -> None:
        """Write the last steps (up to ``TIMELINE_STEPS``) as a Chrome/Perfetto trace (compute,
        swap, wait tracks)."""
        from scheduler.timeline import Event, write_chrome_trace

        if not self.events:
            raise OOCError("no step has run yet: nothing to put on a timeline")
        t0 = self.events[0][2]
        write_chrome_trace([Event(track=tr, name=n, start_s=a - t0, end_s=b - t0, step=s)
                            for tr, n, a, b, s in self.events], path)

    def close(self) -> None:
        """Leave model and optimizer as ordinary PyTorch objects, everything resident."""
        if self._closed:
            return
        try:
            with self.resident():
                pass
            self.pool.trim()   # its idle chunks: no next step to reuse them
        finally:   # even if a tensor cannot be read back (the error names it): no thread, no file
            for h in self._hooks:
                h.remove()
            self.persistent.clear()
            self.tier.close()   # first: its copies may still touch the pool's ranges
            _close_pool(self.pool)
            self._effects.undo()
            self._closed = True

    def __enter__(self) -> "OutOfCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _weakly(method: Any) -> Any:
    """``method`` called through a weak reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else m(*args, **kwargs)
    return call


@dataclass
class _Held:
    """The engine's tier and its current pool, for ``_collected``."""

    tier: Any
    pool: Any


def _collected(hooks: list, effects: ProcessEffects, held: _Held) -> None:
    """An engine was garbage-collected without ``close()``: remove its hooks from the model
    and optimizer, stop its tier's threads, give its pool back, undo its process effects.
    (After ``close()`` each of these is done already and does nothing.)"""
    for h in hooks:
        h.remove()
    try:
        held.tier.close()
        _close_pool(held.pool)
    finally:
        effects.undo()


# The numbers of ``Schedule.summary()`` that ``stats()`` gives as ``plan.<key>``.
PLAN_STAT_KEYS = ("budget", "window", "functions", "variables", "in_core_peak_bytes",
                  "peak_resident_bytes", "bytes_in", "bytes_out")


def _numbers(prefix: str, stats: dict[str, Any]) -> dict[str, int | float]:
    """``stats``' numbers (bools as 0/1) under ``prefix.``; strings and None are settings or
    reasons, not counters, and are left out."""
    return {f"{prefix}.{k}": int(v) if isinstance(v, bool) else v for k, v in stats.items()
            if isinstance(v, (int, float))}


def _start_chunk(budget: int) -> int:
    """The adaptive chunk a CPU engine starts with: 2 MiB, or for a smaller budget the largest
    power of two within it (at least a page: a smaller budget is refused as below a chunk)."""
    if budget >= DEFAULT_CHUNK:
        return DEFAULT_CHUNK
    return max(mmap.PAGESIZE, 1 << (max(budget, 1).bit_length() - 1))


def _close_pool(pool: Any) -> None:
    """Give a pool's device memory back for good: a GPU pool also releases its VMM chunks and
    ranges and the CUDA context it retained (trim alone leaves the context retained), as soon
    as no tensor the user kept lives in it (``CudaDevicePool.close_or_linger``). The CPU pool
    has nothing beyond trim."""
    close = getattr(pool, "close_or_linger", None)
    if close is not None:
        from ooc.runtime.cuda_pool import close_lingering

        close_lingering()   # earlier engines' pools whose last tensors are gone by now
        close()


def _recycle_bytes(budget: int) -> int:
    """The CPU allocator's floor: bytes of freed blocks it may keep even above the step's live
    peak (an eighth of the budget, 32-64 MiB). Above the live peak they would count in the
    process's memory, outside the budget: a fixed 256 MiB cache cost a 2 GiB-budget GPT
    +270 MiB of training memory."""
    return min(max(budget // 8, 32 << 20), 64 << 20)


def _cache_cap(budget: int) -> int:
    """The most the CPU allocator may keep cached: half the budget, at most 256 MiB. Within the
    live-peak bound alone, what the cache held at moments when PyTorch's other memory peaked
    still added up: +20-30 MiB steady peak on VGG16 at 1/2 and 1/4 of its peak, +370 MiB on a
    2 GiB-budget GPT of depth 24 (caps of 1/2 and 1/4 of the budget brought VGG16 back to the
    old allocator's peak; ResNet-50 at 1/4 kept its speed at 1/2, lost some at 1/4)."""
    return min(budget // 2, 256 << 20)


def _round_activations(seq: scheduler.VariableSequence, chunk: int) -> scheduler.VariableSequence:
    """Activations come back into pool ranges of whole chunks: plan with those sizes."""
    from scheduler.ir import Variable, VariableSequence

    variables = {
        v: (Variable(x.id, -(-x.nbytes // chunk) * chunk, x.kind, x.name, x.live_in, x.live_out)
            if x.kind is Kind.ACTIVATION else x)
        for v, x in seq.variables.items()}
    return VariableSequence(seq.functions, variables, seq.meta)
