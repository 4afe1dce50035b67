"""``OutOfCore``: the facade the user holds, over parts that each own their state.

- ``memory.py``: the budget, chunk, pool and tier every part reads (``EngineMemory``; a
  budget for the whole step: ``step_budget.py``);
- ``persistent.py``: the parameters, gradients and optimizer state it manages across steps
  (``PersistentStore``; their uses between steps: ``between_steps.py``);
- ``plan_cache.py``: the plans kept per start and shape, and the step that runs one: the one
  place where a step's form is chosen (``PlanCache``; hook-driven forms: ``hook_forms.py``);
- ``planning.py``: what the engine asks ``scheduler`` after each step, and the chunk (``Planner``);
- ``update_hooks.py``: ``optimizer.step()`` inside a step, the commit point (``UpdateGuard``);
- ``step_end.py``: every step's end, one routine (``StepEnd``); ``step_book.py``: what is kept
  of the steps (``StepBook``); ``stats.py``: ``stats()`` from the parts;
- ``options.py``: ``ooc.Options``, the advanced knobs, and the recompute vocabulary;
  ``arguments.py``: the constructor's arguments checked before anything is made.

This module ties them together: the constructor, ``step()``, ``stats()``,
``set_budget()``, ``resident()``, ``timeline()`` and ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, Hashable, Iterator

import torch

from ooc.engine.arguments import checked
from ooc.engine.lifetime import Held, close_pool, collected, recycle_bytes, weak_method, weakly
from ooc.engine.memory import EngineMemory
from ooc.engine.options import Options
from ooc.engine.persistent import PersistentStore
from ooc.engine.plan_cache import PlanCache
from ooc.engine.planning import Planner
from ooc.engine.step_book import StepBook
from ooc.engine.step_budget import allocator_room, on_demand_bound, recording_room, start_bytes
from ooc.engine.step_end import StepEnd
from ooc.engine.stats import engine_stats
from ooc.engine.step_forms import OpMode
from ooc.engine.update_hooks import UpdateGuard
from ooc.errors import OOCError
from ooc.host import cpu_allocator
from ooc.runtime.composition import check_step_entry, refuse_compiled, state_dict_owner
from ooc.runtime.devices import cuda_runtime, make_tier_and_pool
from ooc.host.process_effects import ProcessEffects
from ooc.runtime.step_context import StepContext
from ooc.runtime.stepper import Stepper
from ooc.runtime.torch_arena import resolve_arena
from ooc.runtime.user_hooks import UserHook
from scheduler.ir import Kind
from vmm.units import parse_size

log = logging.getLogger(__name__)


class OutOfCore:
    """Run training steps under a memory budget by swapping managed tensors to a slower tier.

    The first step records every aten op (forward, backward, optimizer) and the managed
    tensors each one touches, while keeping nothing resident that it does not need (slow,
    but within the budget). The recorded sequence goes to ``scheduler.plan``; the plan is
    proven safe by ``scheduler.check``; every later step executes exactly that plan, with
    transfers on background threads overlapping compute. Plans are kept per step shape (the
    model's inputs); a step that does something else (data-dependent control flow) is noticed
    at its first differing op, finished on demand, and re-planned. Swapping copies bytes:
    parameters come out bitwise identical to in-core training. A plan with nothing to move,
    or only swaps, runs without intercepting ops (``steps.plain``, ``steps.anchored``).

    Args:
        model: the ``nn.Module`` to train, on ``device``.
        optimizer: its optimizer. With ``params``/``grads``/``optimizer_state`` managed it is
            switched to its per-parameter implementation (``foreach=False``) so that one op
            never needs every parameter at once.
        budget: bytes (int) or a size string ("512MiB", "2GB") for the managed tensors.
        device: ``"cpu"`` (slower tier: a private swap file) or ``"cuda"`` (pinned host
            memory and copy streams; written against the driver API and tested against a fake
            driver in CI; run on an H100 and an H200, see docs/guide/gpu.md).
        manage: which tensors may leave the device: any of "activations" (saved for
            backward), "params", "grads", "optimizer_state". Default: activations.
        recompute: "auto" (default): the plan may discard a saved activation and rerun the
            ops that made it before the backward needs it, where that costs less than swapping
            it (priced on the device, ``scheduler.recompute``; the replay gives the same bytes:
            random ops replay their generator state, BatchNorm does not update its running
            statistics twice). "never": swap only. "prefer": recompute every activation the
            budget forces out that can be (tests, and devices where moving bytes is dearest).
            The scheduler's words (``scheduler.plan(recompute=...)``, ``ooc plan --recompute``).
        pin: the user's say per op, as torch.utils.checkpoint's selective checkpointing
            policy: ``{op: pin}`` or ``fn(op) -> pin | None``, a pin being "keep" (never
            leaves the device), "offload" (swapped, never recomputed), "prefer_recompute",
            "must_recompute" (recomputed even when the budget would keep it) or a
            ``CheckpointPolicy``; it applies to the activations the op saves
            (``ooc/engine/pin_policy.py``, ``scheduler/pins.py``).
        storage: directory in which a private 0700 swap directory is made (default: $TMPDIR).
        options: the advanced knobs (``ooc.Options``: chunk, min_bytes, window, threads,
            verify, hook_steps, max_plans).

    Example::

        engine = ooc.OutOfCore(model, opt, budget="256MiB")
        for x, y in batches:
            with engine.step():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()   # or scaler.step(opt); the engine hooks the optimizer
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 budget: int | str, device: str | torch.device = "cpu",
                 manage: tuple[str, ...] | list[str] | str = ("activations",), recompute: str = "auto",
                 pin: Any = None, storage: str | None = None, options: Options | None = None) -> None:
        options = Options() if options is None else options
        args = checked(model, optimizer, budget, device, manage, recompute, pin, options)
        budget, device, chunk, min_bytes = args.budget, args.device, args.chunk, args.min_bytes
        self._manage = manage = args.manage
        self.model, self.optimizer, self.device = model, optimizer, device
        self._stepped = optimizer = args.optimizer   # the one whose step() is the update (``stepped_optimizer``)
        # What the steps change outside the engine (PyTorch's CPU allocator, glibc's mmap threshold, the
        # foreach flag): made at the first step, undone by close() or collection (ooc/host/process_effects.py).
        self._effects = ProcessEffects(device.type, optimizer, args.per_parameter,
                                       whole_step=options.budget_covers == "step")
        # CPU: a swap file and a pool of anonymous chunks; CUDA: pinned host memory and PyTorch's allocator
        # for the swap-ins (or a VMM pool: Options.arena). The pool checks the chunk's granularity first.
        arena = resolve_arena(device, options.arena)
        tier, pool = make_tier_and_pool(device, budget, chunk, storage, options.threads, options.verify, arena=arena)
        self._mem = mem = EngineMemory(device, budget, chunk, min_bytes, tier, pool, Held(tier, pool), arena, manage)
        if options.budget_covers == "step":   # a budget for the whole step (step_budget.py)
            mem.step_budget, mem.step_start = budget, start_bytes(model, optimizer, self._manage, mem.min_bytes)
            mem.budget = recording_room(mem)
        self._store = store = PersistentStore(model, optimizer, mem)
        self._plans = PlanCache(mem, store, model, activations_only=self._manage == {"activations"},
                                activations="activations" in self._manage, hook_steps=options.hook_steps,
                                max_plans=options.max_plans, new_stepper=weak_method(self._new_stepper))
        self._planner = Planner(mem, self._plans, window=options.window, policy="window", recompute=args.recompute,
                                pin=args.pin, adaptive=args.adaptive, adopt_params=weak_method(self._adopt_params))
        self._book = StepBook()
        self._room: tuple[Any, tuple[int, int], int | None] = (None, (0, 0), None)   # _allocator_room's last
        self._end = StepEnd(mem, store, self._book, self._planner, model=model, optimizer=optimizer,
                            manage=self._manage)
        self._stepper: Stepper | Any = None   # the running step (None between steps)
        self._guard = UpdateGuard(mem, store, self._planner, self._plans, model=model, optimizer=optimizer,
                                  manage=self._manage)
        ref = weakref.ref(self)
        self._hooks: list = refuse_compiled(model, lambda: (e := ref()) is not None and e._stepper is not None)
        self._closed = False
        self._adopt_params()
        if "optimizer_state" in self._manage and optimizer is not None and optimizer.state:
            self._store.state_loaded(optimizer, stepping=False)   # a resumed run's: stayed unmanaged before
        if "grads" in self._manage:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(UserHook(_grad_hook(ref, name))))
        if "optimizer_state" in self._manage and optimizer is not None:
            self._hooks.append(optimizer.register_load_state_dict_post_hook(UserHook(self._state_loaded)))
        if self._manage & {"params", "grads", "optimizer_state"}:
            owner = state_dict_owner(model)   # DDP: its .module, whose hooks cover both
            bring_back = UserHook(self._bring_back_hook)   # (holds the engine: see below)
            self._hooks += [owner.register_state_dict_pre_hook(bring_back),
                            owner.register_load_state_dict_pre_hook(bring_back)]
            if optimizer is not None:
                self._hooks.append(optimizer.register_state_dict_pre_hook(bring_back))
        # The step's shape, from the model's inputs, picks its plan (plan_cache.py): first, before
        # hooks that run ops (FSDP2's all-gather), so that the step can still switch its plan.
        self._hooks.append(model.register_forward_pre_hook(weakly(self._forward_starts), prepend=True,
                                                            with_kwargs=True))
        if optimizer is not None:   # the update starts at optimizer.step(), however it is called
            # Held weakly: an engine that manages activations only keeps nothing between steps,
            # so a user who drops it without close() loses nothing, and it can be collected
            # while model and optimizer live on. One that manages persistent tensors owns their
            # swapped bytes between steps: the model's hooks above keep it alive with the model.
            self._hooks += [optimizer.register_step_pre_hook(weakly(self._guard.update_starts)),
                            optimizer.register_step_post_hook(weakly(self._guard.update_done))]
        # Collected without close(): unhook, and put back what the steps changed outside.
        # (``mem.held`` follows the pool when the chunk changes; it references nothing that
        # refers to the engine, or the engine could never be collected.)
        weakref.finalize(self, collected, self._hooks, self._effects, mem.held)

    @contextlib.contextmanager
    def step(self, kind: Hashable = None) -> Iterator[None]:
        """One training step. The first records and plans; later ones execute the plan.

        The update is ``optimizer.step()`` wherever it is called inside the step (directly,
        by ``GradScaler.step``, or by ``optimizer_step()``); a step without one (a micro-batch
        of gradient accumulation, an update the scaler skipped) is a step too. Plans are kept
        per starting state and ``kind`` (steps that start alike, run other ops: Lightning's).

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
        check_step_entry(OpMode, "activations" in self._manage)
        if not self._effects.applied:   # the first step (see ProcessEffects)
            self._effects.apply()
        t0 = time.perf_counter()
        self._store.enter_step()   # plain tensors from here on, the ones still held, stable ids
        mem = self._mem
        if mem.on_cpu:   # hook-driven steps too; before reconcile: what it lets go of is recycled
            floor = recycle_bytes(mem.step_budget or mem.budget, whole_step=bool(mem.step_budget))
            if mem.step_budget:   # a step budget's share: a cap too, where glibc's tensors leave no room
                cpu_allocator.begin(mem, floor, floor, self._allocator_room())
            else:
                cpu_allocator.begin(mem, floor)
        try:   # the plan and the step's form (plan_cache.py)
            form = self._plans.begin(self._store.start_key(kind))
        except BaseException:
            cpu_allocator.end(mem)
            raise
        self._stepper = form.st   # the forward may switch form.st (_forward_starts)
        try:
            with form:
                yield
        except BaseException as exc:   # the user's code, a swap failure, Ctrl-C: roll back, re-raise
            st = self._end_step(form)
            try:
                raised = self._end.unwound(st, exc, time.perf_counter() - t0)
            finally:   # an update that raised: a Ctrl-C it held is delivered now
                self._guard.interrupts.release()
            if raised is exc:
                raise
            raise raised from exc
        st = self._end_step(form)
        if not mem.on_cpu and self._plans.hooked.on_trial(st.start_key, st.schedule):
            cuda_runtime().device_done()   # a trial compares the device's time, not the host's launches
        self._end.finish(st, None, time.perf_counter() - t0)

    def _end_step(self, form: Any) -> Any:
        """The step's body is over: its object, no longer the running one; its plan is now the
        most recently used (``plan_cache.py``: least recently used out)."""
        st, self._stepper, self._plans.form = form.st, None, None
        self._plans.used(st.start_key)
        return st

    def optimizer_step(self) -> None:
        """``optimizer.step()`` then ``zero_grad(set_to_none=True)``, inside the managed step.

        A convenience: ``optimizer.step()`` (or ``scaler.step(optimizer)``) inside
        ``with engine.step():`` is recognised as the update by itself."""
        self._guard.optimizer_step(self.optimizer)

    def stats(self) -> dict[str, int | float]:
        """Flat numbers with stable keys, the same on every device, like
        ``torch.cuda.memory_stats()``: what moved, what stalled, what the plan says, how many
        steps of each form ran. Every key is there from the start (0 before the first step;
        ``last_diverged_at`` and ``last_form`` are -1). The keys are listed in
        docs/guide/budgets.md ("What the engine did")."""
        return engine_stats(self._book, self._mem, self._plans, self._store.reads)

    def _allocator_room(self) -> int | None:
        """``step_budget.allocator_room`` of the last whole recording, once per recording, budget
        and records kept; None without one (the cache's share alone caps it)."""
        whole, mem = self._end.last_recording, self._mem
        if whole is None:
            return None
        kept = (mem.step_budget, mem.step_records)
        if self._room[0] is not whole or self._room[1] != kept:
            self._room = (whole, kept, allocator_room(mem, whole))
        return self._room[2]

    @property
    def last_recording(self) -> Any:
        """The last step that ran unplanned (the recording step), whole, as ``ooc.trace``
        records a step: every storage, of every kind, with the same recorder (``ooc/record/``).
        None until one completed."""
        return self._end.last_recording

    def set_budget(self, budget: int | str) -> None:
        """Change the budget; the next step records again and re-plans under it. With the
        default chunk, that step also chooses the chunk again (never a larger one)."""
        new, mem = parse_size(budget, what="budget"), self._mem
        mem.step_start = start_bytes(self.model, self._stepped, self._manage, mem.min_bytes) if mem.step_budget else 0
        self._planner.set_budget(new)
        self._store.bring_back_if_fits(between_steps=True)   # under the new budget, as a step's end

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Bring every managed parameter, grad and state tensor back at once, e.g. to evaluate
        or save (plain tensors until the next step).

        Never needed for correctness: between steps, where they exceed the budget, any use of
        one brings back what it uses, within the budget where it can; otherwise every step's
        end already brought them back. The next step puts them where its plan wants them.
        """
        self._store.bring_back()
        yield

    def timeline(self, path: str) -> None:
        """Write the last steps (up to ``TIMELINE_STEPS``) as a Chrome/Perfetto trace (compute,
        swap, wait tracks)."""
        self._book.timeline(path)

    def close(self) -> None:
        """Leave model and optimizer as ordinary PyTorch objects, everything resident."""
        if self._closed:
            return
        mem = self._mem
        try:
            self._store.bring_back()
            mem.pool.trim()   # its idle chunks: no next step to reuse them
        finally:   # even if a tensor cannot be read back (the error names it): no thread, no file
            for h in self._hooks:
                h.remove()
            self._store.slots.clear()
            self._store.closed = True
            mem.tier.close()   # first: its copies may still touch the pool's ranges
            close_pool(mem.pool)
            self._effects.undo()
            self._closed = True

    def __enter__(self) -> "OutOfCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- wiring between the parts --------------------------------------------------------------

    def _new_stepper(self, key: Any, schedule: Any, binding: dict, plain_candidate: bool,
                     plan_runs: int, quiet_ops: frozenset[int] = frozenset()) -> Stepper:
        """A per-op step of ``schedule`` (None: on demand) for plan key ``key``, with what it
        needs from the engine (``ooc/runtime/step_context.py``)."""
        mem, persistent = self._mem, tuple(self._store.slots.values())
        device_budget, device_live = on_demand_bound(mem, self.model, self._stepped, self._manage)   # (a step budget)
        # On demand, bounded by the device's live bytes: the room beside what the step starts
        # with, as the first recording's, not the share fitted for plans, which counts the
        # update's temporaries beside the managed tensors where on demand they count among them
        # (a VAE's second step, the first with Adam's state, refused a step budget the first took)
        budget = mem.budget
        if schedule is None and device_live is not None:
            budget = max(budget, recording_room(mem))
        ctx = StepContext(budget=budget, chunk=mem.chunk, min_bytes=mem.min_bytes, manage=self._manage,
                          device=mem.device, tier=mem.tier, pool=mem.pool, new_var=self._store.new_var,
                          counters=mem.counters, model=self.model, optimizer=self._stepped, persistent=persistent,
                          plan_runs=plan_runs, start_key=key, plain_candidate=plain_candidate, quiet_ops=quiet_ops,
                          trace_recording=schedule is None and self._plans.hooked.tracing(key),
                          unformed=(formed := self._plans.hooked.get(key)) is None or formed.plan is not schedule,
                          time_ops=self._planner.times_ops(key, schedule), device_budget=device_budget,
                          device_live=device_live)
        return Stepper(ctx, schedule, binding, observe_small=self._planner.chunks.pending)

    def _adopt_params(self) -> None:
        """With params managed, manage every parameter at or over the threshold."""
        if "params" in self._manage:
            for name, p in self.model.named_parameters():
                self._store.adopt(p, Kind.PARAM, name)

    def _forward_starts(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: the step's shape is known (``PlanCache.forward_starts``)."""
        new = self._plans.forward_starts(args, kwargs)
        if new is not None:
            self._stepper = new

    def _state_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self._store.state_loaded(optimizer, stepping=self._stepper is not None)

    def _bring_back_hook(self, *args: Any, **kwargs: Any) -> None:
        """``state_dict()``/``load_state_dict()`` pre-hook: their reads and copies need the
        bytes (inside a step the stepper brings each tensor back at its use)."""
        if self._stepper is None and not self._closed:
            self._store.bring_back()


def _grad_hook(engine: weakref.ref, name: str) -> Any:
    """A parameter's post-accumulate-grad hook: a new gradient becomes managed. A parameter's
    hooks are held from C++, where the garbage collector cannot follow them: a hook that held
    the engine would keep it, and with it the model, forever (``engine`` is a weak reference;
    the model's state_dict hooks, Python, keep the engine alive while the model lives)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def hook(p: torch.nn.Parameter) -> None:
        e = engine()
        st = None if e is None else e._stepper
        if st is None or p.grad is None:
            return
        if p.grad._base is not None:   # a window onto another owner's buffer (StepEnd._live_out)
            return
        with _disable_current_modes():
            st.adopt_grad_of(p.grad, name)
    return hook
