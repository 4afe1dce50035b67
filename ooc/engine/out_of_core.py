"""``OutOfCore``: its settings, the step context manager, statistics and closing.

The class is composed of one part per responsibility (the package docstring lists them);
this module holds what ties them together: the constructor and its validation, ``step()``
(which hands the ``Stepper`` its ``StepContext``), ``stats()``, ``set_budget()``,
``timeline()`` and ``close()``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections import Counter
from typing import Any, Hashable, Iterator

import torch

import scheduler
from ooc.engine.anchored_steps import AnchoredSteps
from ooc.engine.lifetime import Held, close_pool, collected, recycle_bytes, weakly
from ooc.engine.persistent import PersistentTensors
from ooc.engine.pin_policy import pin_function
from ooc.engine.plain_steps import PlainSteps
from ooc.engine.planning import DEFAULT_CHUNK, Planning, _start_chunk
from ooc.engine.step_end import StepEnd, partial_update_error
from ooc.engine.step_forms import OpMode
from ooc.engine.update_hooks import UpdateHooks
from ooc.errors import OOCError, StorageError
from ooc.runtime import cpu_allocator
from ooc.runtime.composition import check_sharded_params, check_step_entry, refuse_compiled, state_dict_owner
from ooc.runtime.devices import cuda_runtime, make_tier_and_pool
from ooc.runtime.pool import DevicePool
from ooc.runtime.process_effects import ProcessEffects
from ooc.runtime.step_context import StepContext
from ooc.runtime.stepper import Stepper
from ooc.storage.tier import SlowerTier
from scheduler.ir import Kind
from vmm.units import format_size, parse_size

log = logging.getLogger(__name__)

KINDS = ("activations", "params", "grads", "optimizer_state")


class OutOfCore(PersistentTensors, UpdateHooks, StepEnd, Planning, PlainSteps, AnchoredSteps):
    """Run training steps under a memory budget by swapping managed tensors to a slower tier.

    The first step records every aten op (forward, backward, optimizer) and the managed
    tensors each one touches, while keeping nothing resident that it does not need (slow,
    but within the budget). The recorded sequence goes to ``scheduler.plan``; the plan is
    proven safe by ``scheduler.check``; every later step executes exactly that plan, with
    transfers on background threads overlapping compute. Plans are kept per step shape (the
    model's inputs, ``planning.py``); a step that does something else (data-dependent control
    flow) is noticed at its first differing op, finished on demand, and re-planned. Swapping
    copies bytes: parameters come out bitwise identical to in-core training. A plan with
    nothing to do runs plain (``plain_steps.py``).

    Args:
        model: the ``nn.Module`` to train, on ``device``.
        optimizer: its optimizer. With ``params``/``grads``/``optimizer_state`` managed it is
            switched to its per-parameter implementation (``foreach=False``) so that one op
            never needs every parameter at once.
        budget: bytes (int) or a size string ("512MiB", "2GB") for the managed tensors.
        device: ``"cpu"`` (slower tier: a private swap file) or ``"cuda"`` (pinned host
            memory and copy streams; written against the driver API and tested against a fake
            driver in CI; run on an H100 and an H200, see docs/guide/gpu.md).
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
        recompute: let the plan discard a saved activation and rerun the ops that made it
            before the backward needs it, where that costs less than swapping it (priced on
            the device, ``scheduler.recompute``; the replay gives the same bytes: random ops
            replay their generator state, BatchNorm does not update its running statistics
            twice). False: swap only. "prefer": recompute every activation the budget
            forces out that can be (tests, and devices where moving bytes is dearest).
        pin: the user's say per op, as torch.utils.checkpoint's selective checkpointing
            policy: ``{op: pin}`` or ``fn(op) -> pin | None``, a pin being "keep" (never
            leaves the device), "offload" (swapped, never recomputed), "prefer_recompute",
            "must_recompute" (recomputed even when the budget would keep it) or a
            ``CheckpointPolicy``; it applies to the activations the op saves
            (``ooc/engine/pin_policy.py``, ``scheduler/pins.py``).

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
                 verify: bool = False, min_bytes: int | str | None = None, threads: int = 2,
                 recompute: bool | str = True, pin: Any = None) -> None:
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
        check_sharded_params(model, self.manage)   # FSDP2: activations only
        if policy not in scheduler.POLICIES:
            raise OOCError(f"policy {policy!r} is not one of {list(scheduler.POLICIES)}")
        self.policy = policy
        if recompute not in (True, False, "prefer"):
            raise OOCError(f"recompute must be True, False or 'prefer', got {recompute!r}")
        self.recompute = recompute
        self._pin = pin_function(pin)
        if self._pin is not None and policy != "window":
            raise OOCError(f"pin: policy {policy!r} does not take pins; they belong to policy 'window'")
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
        # or when the engine is collected (ooc/runtime/process_effects.py).
        self._effects = ProcessEffects(self.device.type, optimizer, per_parameter)
        # CPU: a swap file and a pool of anonymous chunks; CUDA: pinned host memory and a VMM pool. The pool
        # checks the chunk against the backend's granularity before anything else is made.
        self.tier, self.pool = make_tier_and_pool(self.device, self.budget, self.chunk, storage,
                                                  threads, verify)
        self._init_persistent()
        self._init_plans()
        self._init_plain()
        self._init_anchored()
        self.counters: Counter = Counter()
        self.last: dict[str, Any] = {}
        self.events: list[tuple[str, str, float, float, int]] = []
        self._stepper: Stepper | None = None
        ref = weakref.ref(self)
        self._hooks: list = refuse_compiled(model, lambda: (e := ref()) is not None and e._stepper is not None)
        self._closed = False
        self._init_update()
        if "params" in self.manage:
            for name, p in model.named_parameters():
                self._adopt(p, Kind.PARAM, name)
        if "grads" in self.manage:
            for name, p in model.named_parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        if "optimizer_state" in self.manage and optimizer is not None:
            self._hooks.append(optimizer.register_load_state_dict_post_hook(self._state_loaded))
        if self.manage & {"params", "grads", "optimizer_state"}:
            owner = state_dict_owner(model)   # DDP: its .module, whose hooks cover both
            self._hooks += [owner.register_state_dict_pre_hook(self._bring_back_hook),
                            owner.register_load_state_dict_pre_hook(self._bring_back_hook)]
            if optimizer is not None:
                self._hooks.append(optimizer.register_state_dict_pre_hook(self._bring_back_hook))
        # The step's shape, from the model's inputs, picks its plan (planning.py): first, before
        # hooks that run ops (FSDP2's all-gather), so that the step can still switch its plan.
        self._hooks.append(model.register_forward_pre_hook(weakly(self._forward_starts), prepend=True,
                                                            with_kwargs=True))
        if optimizer is not None:   # the update starts at optimizer.step(), however it is called
            # Held weakly: an engine that manages activations only keeps nothing between steps,
            # so a user who drops it without close() loses nothing, and it can be collected
            # while model and optimizer live on. One that manages persistent tensors owns their
            # swapped bytes between steps: the model's hooks above keep it alive with the model.
            self._hooks += [optimizer.register_step_pre_hook(weakly(self._update_starts)),
                            optimizer.register_step_post_hook(weakly(self._update_done))]
        # Collected without close(): unhook, and put back what the steps changed outside.
        # (``_held`` follows the pool when the chunk changes; it references nothing that refers
        # to the engine, or the engine could never be collected.)
        self._held = Held(self.tier, self.pool)
        weakref.finalize(self, collected, self._hooks, self._effects, self._held)

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
        check_step_entry(OpMode, "activations" in self.manage)
        if not self._effects.applied:   # the first step (see ProcessEffects)
            self._effects.apply()
        t0 = time.perf_counter()
        self._enter_step()   # plain tensors from here on, the ones still held, stable ids
        if self.device.type == "cpu":   # plain steps too; before _reconcile: what it lets go of is recycled
            cpu_allocator.begin(self, recycle_bytes(self.budget))
        try:   # the plan and the step's form (per op, plain, anchored: planning.py, step_forms.py)
            form = self._begin(self._start_key(kind))
        except BaseException:
            cpu_allocator.end(self)
            raise
        self._stepper, self._form = form.st, form   # the forward may switch form.st (_forward_starts)
        try:
            with form:
                yield
        except BaseException as exc:   # the user's code, a swap failure, Ctrl-C: roll back, re-raise
            st, self._stepper, self._form = form.st, None, None
            committed = st.rollback.undo is None   # past the commit point: nothing to roll back
            try:
                self._finish_step(st, exc, time.perf_counter() - t0)
            finally:   # an update that raised: a Ctrl-C it held is delivered now
                self._interrupts.release()
            if committed and isinstance(exc, StorageError):
                raise partial_update_error(exc, during_step=st.updating) from exc
            raise
        st, self._stepper, self._form = form.st, None, None
        self._finish_step(st, None, time.perf_counter() - t0)

    def _finish_step(self, st: Any, exc: BaseException | None, seconds: float) -> None:
        """A per-op step's end (``step_end.py``), or a plain or anchored one's (``plain_steps.py``).
        Its shape's plan is now the most recently used (``planning.py``: least recently used out)."""
        if st.start_key in self.plans:
            self.plans.move_to_end(st.start_key)
        (self._finish if isinstance(st, Stepper) else self._finish_plain)(st, exc, seconds)

    def _step_context(self, key: Any) -> StepContext:
        """What the step that starts now needs from the engine (``ooc/runtime/step_context.py``)."""
        runs = self.plan_runs.get(id(self.schedule), 0) if self.schedule is not None else 0
        return StepContext(budget=self.budget, chunk=self.chunk, min_bytes=self.min_bytes,
                           manage=self.manage, device=self.device, tier=self.tier, pool=self.pool,
                           new_var=self._ids.__next__, counters=self.counters, model=self.model,
                           optimizer=self.optimizer, persistent=tuple(self.persistent.values()),
                           plan_runs=runs, start_key=key, plain_candidate=self._plain_candidate())

    def stats(self) -> dict[str, int | float]:
        """Flat numbers with stable keys, like ``torch.cuda.memory_stats()``: what moved, what
        stalled, what the plan says. Every key is there from the start (0 before the first
        step; ``last_diverged_at`` is -1 when the last step kept to its plan). The keys are
        listed in docs/guide/budgets.md ("What the engine did"); ``tier.*`` are the slower
        tier's own counters (its numbers only; its settings are its attributes)."""
        last = self.last
        diverged = last.get("diverged_at")
        ran = self._ran or self.schedule   # an anchored step ran its own plan
        plan = ran.summary() if ran is not None else {}
        out: dict[str, int | float] = {
            "steps": self.counters["steps"],
            "plans": self.counters["plans"],
            "plans_kept": len(self.plans),
            "plain_steps": self.counters["plain_steps"],
            "anchored_steps": self.counters["anchored_steps"],
            "bytes_in": self.counters["bytes_in"],
            "bytes_out": self.counters["bytes_out"],
            "bytes_recomputed": self.counters["bytes_recomputed"],
            "recompute_s": float(self.counters["recompute_s"]),
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
        out.update(self._reads.stats())   # between_steps.*: reads between steps
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
            close_pool(self.pool)
            self._effects.undo()
            self._closed = True

    def __enter__(self) -> "OutOfCore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# The numbers of ``Schedule.summary()`` that ``stats()`` gives as ``plan.<key>``.
PLAN_STAT_KEYS = ("budget", "window", "functions", "variables", "in_core_peak_bytes",
                  "peak_resident_bytes", "bytes_in", "bytes_out", "bytes_recomputed")


def _numbers(prefix: str, stats: dict[str, Any]) -> dict[str, int | float]:
    """``stats``' numbers (bools as 0/1) under ``prefix.``; strings and None are settings or
    reasons, not counters, and are left out."""
    return {f"{prefix}.{k}": int(v) if isinstance(v, bool) else v for k, v in stats.items()
            if isinstance(v, (int, float))}
