"""Whether a recorded op may be replayed (recomputation): the recorder's verdict, per op.

``scheduler.ir.Function`` has three flags, all False unless the recorder sets them:
``replayable`` (rerunning the op on the same inputs gives the same bytes and touches nothing
outside its uses), ``rng`` (only with the generator state captured and restored) and
``updates_stats`` (BatchNorm in training mode: the replay must not update the running
statistics again). The planner (``scheduler.replay.chain_for``) only ever reruns functions
marked ``replayable``. Both drivers (``ooc.trace``'s dispatch mode and the engine's
recording step) call ``StepRecorder.op``, which applies these rules: the same step gets the
same flags whoever records it.

The rules are worked out once per op from its schema and tags (``replay_rule``, kept in
``OpInfo.replay``), in this order; the first that matches decides:

1. *not an aten op* (collectives of ``c10d``/``_c10d_functional``, user and library custom
   ops): not replayable, their side effects are unknown;
2. *tags*: ``data_dependent_output`` (``_local_scalar_dense``, i.e. ``.item()``),
   ``nondeterministic_bitwise`` (a rerun may give other bits), ``inplace_view`` (``set_``,
   ``resize_``, ``transpose_``: change a tensor's metadata), ``maybe_aliasing_or_mutating``:
   not replayable;
3. *no tensor result* (``_foreach_*_`` updates, asserts, ``record_stream``, ops returning
   scalars): not replayable; nothing to recompute, and what they do is a side effect;
4. *views* (every result aliases an argument, nothing written: ``view``, ``t``, ``detach``):
   not replayable. They allocate nothing (the recorder keeps them as functions without
   uses), so no chain ever needs them: a replay re-creates its arguments' views from their
   recorded sizes and strides instead;
5. *BatchNorm* (``native_batch_norm``, ``_native_batch_norm_legit``, ``cudnn_batch_norm``,
   ``miopen_batch_norm``, ``_batch_norm_with_update``; not their ``.out`` overloads):
   replayable; ``updates_stats`` when it runs in training mode with running statistics
   (decided per call from its ``training`` argument: the schemas of ``native_batch_norm`` and
   the cuDNN/MIOpen ops do not even mark the running statistics as written). The eval and
   no-update variants (``_native_batch_norm_legit_no_training``, ``_batch_norm_no_update``)
   are plain ops and fall through to rule 8;
6. *writes* (an argument annotated ``Tensor(a!)``):

   - ``out=`` ops (tag ``out``, or a keyword-only argument written): not replayable;
   - an *in-place* op whose only write is its first argument (``self``), which it returns
     (``relu_``, ``add_``, ``bernoulli_``, ``div_``): replayable, except ``copy_`` (it moves
     bytes between devices and loads state; a fresh copy is ``clone``/``_to_copy``). Such an
     op is never replayed on its own: ``chain_for`` puts it in the chain of the variable it
     writes, after that variable's producer, so the replay applies it once to freshly
     re-created bytes (``relu_`` after a BatchNorm, ``out += identity``, dropout's
     ``empty_like().bernoulli_(p).div_(1 - p)`` on CPU and meta); a chain whose in-place
     op writes anything else is refused there. Without this, no output of a
     conv-BN-ReLU(inplace) block and no CPU dropout mask could ever be recomputed;
   - any other write (an op mutating an input besides ``self``, or a list): not replayable;
7. *random*: tag ``nondeterministic_seeded`` (``native_dropout``, ``bernoulli_``, ``rand*``,
   ``normal``): replayable with ``rng``, unless the call passes a ``torch.Generator`` of its
   own (a batch drawn inside the step from ``torch.Generator().manual_seed(step)``): the
   replay restores the default generator's state, not that one's, and drew other numbers
   (not bitwise from the first planned step until 2026-11-29);
8. everything else (convolutions, matmuls, pointwise ops, norms, reductions, allocations
   such as ``empty_like`` whose bytes are unspecified anyway): replayable.

Three more rules are about the call, not the op (``StepRecorder``): a result that aliases
an existing storage although the schema says it is fresh (``_unsafe_view``) makes the call
not replayable; so does an in-place write to a storage that existed before the step
(parameters, buffers such as BatchNorm's ``num_batches_tracked``, optimizer state: nothing
can re-create them); and nothing of the optimizer phase is replayable (the update runs once
per step; its inputs are the state it mutates, and no later function needs its temporaries
again).

Tensors mutated after production (``relu_`` on a BatchNorm's output) need no rule here:
``chain_for`` folds every write of the target before the use into its chain, and refuses
the chain if one of them is not replayable or writes another variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReplayRule", "replay_rule"]

# BatchNorm ops that update running statistics in training mode (overload packet names).
_BATCH_NORM = frozenset({"native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm",
                         "miopen_batch_norm", "_batch_norm_with_update"})
_NOT_REPLAYABLE_TAGS = tuple(getattr(torch.Tag, t) for t in (
    "data_dependent_output", "nondeterministic_bitwise", "inplace_view", "maybe_aliasing_or_mutating")
    if hasattr(torch.Tag, t))
_OUT_TAG = getattr(torch.Tag, "out", None)
_NEVER_INPLACE = frozenset({"copy_"})


@dataclass(frozen=True, slots=True)
class ReplayRule:
    """What an op's schema says about replaying it. ``replayable``/``rng`` hold for every
    call; ``training`` and ``running_mean`` are BatchNorm's (position, name) of those
    arguments (None for other ops): such a call ``updates_stats`` when it trains with running
    statistics (``always_training``: an op that has no ``training`` argument because it always
    does, ``_batch_norm_with_update``). ``why``: the rule that made the op not replayable
    (empty otherwise), for messages and tests."""

    replayable: bool
    rng: bool = False
    training: tuple[int, str] | None = None
    running_mean: tuple[int, str] | None = None
    always_training: bool = False
    why: str = ""
    generator: tuple[int, str] | None = None   # a random op's Generator argument (rule 7)

    def updates_stats(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call (a BatchNorm) updates running statistics."""
        if self.running_mean is None:
            return False
        if _arg(args, kwargs, self.running_mean) is None:
            return False
        return self.always_training or bool(_arg(args, kwargs, self.training))

    def flags(self, args: tuple, kwargs: dict) -> tuple[bool, bool, bool]:
        """``Function``'s (replayable, rng, updates_stats) for this call of a replayable op
        (the call rules of ``StepRecorder.op`` decided it may be replayed): not one given a
        generator of its own (rule 7)."""
        if self.generator is not None and _arg(args, kwargs, self.generator) is not None:
            return False, False, False
        return True, self.rng, self.updates_stats(args, kwargs)


_NEVER_OTHER = ReplayRule(False, why="not a schema op")


def replay_rule(func: Any, view: bool, writes: tuple[tuple[int, str], ...]) -> ReplayRule:
    """The replay rule of ``func`` (the module docstring's rules 1-8). ``view`` and
    ``writes`` are ``OpInfo``'s facts (a view op; the (position, name) of written args)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _NEVER_OTHER
    namespace = getattr(func, "namespace", "")
    if namespace != "aten":
        return ReplayRule(False, why=f"an op of namespace {namespace!r}: side effects unknown")
    tags = getattr(func, "tags", ())
    for tag in _NOT_REPLAYABLE_TAGS:
        if tag in tags:
            return ReplayRule(False, why=f"tagged {tag}")
    if not any("Tensor" in str(r.type) for r in schema.returns):   # Tensor, Tensor[], Tensor?
        return ReplayRule(False, why="returns no tensor")
    if view:
        return ReplayRule(False, why="a view (allocates nothing)")
    packet = schema.name.split("::")[-1]
    # ``Tag.out`` is newer than some PyTorch releases the package supports (2.11 has none):
    # the schema's own out arguments say the same everywhere.
    is_out = (_OUT_TAG is not None and _OUT_TAG in tags) or any(
        getattr(a, "is_out", False) or (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
        for a in schema.arguments)
    if packet in _BATCH_NORM and not is_out:
        names = [a.name for a in schema.arguments]
        mean = ("running_mean" in names and (names.index("running_mean"), "running_mean")) or None
        training = ("training" in names and (names.index("training"), "training")) or None
        return ReplayRule(True, training=training, running_mean=mean,
                          always_training=packet == "_batch_norm_with_update")
    if writes:
        if is_out:
            return ReplayRule(False, why="an out= op")
        first = schema.arguments[0] if schema.arguments else None
        inplace = (len(writes) == 1 and writes[0][0] == 0 and first is not None
                   and str(first.type) == "Tensor" and len(schema.returns) == 1
                   and schema.returns[0].alias_info is not None
                   and schema.returns[0].alias_info.is_write)
        if not inplace:
            return ReplayRule(False, why="writes an input other than self")
        if packet in _NEVER_INPLACE:
            return ReplayRule(False, why=f"{packet} (moves bytes between devices, loads state)")
    generator = next(((i, a.name) for i, a in enumerate(schema.arguments) if "Generator" in str(a.type)), None)
    return ReplayRule(True, rng=torch.Tag.nondeterministic_seeded in tags, generator=generator)


def _arg(args: tuple, kwargs: dict, where: tuple[int, str] | None) -> Any:
    """The argument at (position, name): passed by position, else by keyword, else None."""
    if where is None:
        return None
    pos, name = where
    return args[pos] if pos < len(args) else kwargs.get(name)
