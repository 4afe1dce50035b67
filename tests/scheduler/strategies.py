"""Sequences for scheduler tests: hypothesis strategies and deterministic builders.

- ``sequences()``: random but valid variable sequences (random creations, reads, writes,
  live_in parameters, some live_out variables, zero-byte and never-used variables).
- ``training_like_sequence(layers, ...)``: a forward pass that saves activations, a loss, a
  backward pass that reads them in reverse order and creates gradients, and an optimizer
  step that updates parameters and optimizer state in place. ``style="cnn"`` shrinks
  activations with depth (ResNet-like stages), ``style="transformer"`` keeps them uniform
  with a large attention temporary per block.
- ``training_sequences()``: hypothesis strategy over ``training_like_sequence`` arguments.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import strategies as st

from scheduler import Cost, Kind, Variable, VariableSequence, build_sequence

__all__ = ["sequences", "training_like_sequence", "training_sequences", "random_sequence"]


def random_sequence(rng: random.Random, *, max_functions: int = 20, max_bytes: int = 100) -> VariableSequence:
    """One random valid sequence drawn from ``rng`` (shared by the hypothesis strategy)."""
    variables: list[Variable] = []
    kinds = [Kind.PARAM, Kind.OPTIMIZER_STATE, Kind.INPUT]
    for _ in range(rng.randint(0, 4)):
        vid = len(variables)
        variables.append(Variable(
            vid, rng.choice([0, *range(1, max_bytes + 1)]) if rng.random() < 0.05 else rng.randint(1, max_bytes),
            rng.choice(kinds), name=f"in{vid}", live_in=True, live_out=rng.random() < 0.7))
    existing = [v.id for v in variables]
    functions: list[tuple[str, list[tuple[int, str]], Cost]] = []
    for i in range(rng.randint(1, max_functions)):
        uses: list[tuple[int, str]] = []
        if existing:
            for v in rng.sample(existing, k=min(len(existing), rng.randint(0, 3))):
                uses.append((v, "w" if rng.random() < 0.15 else "r"))
        for _ in range(rng.choice([0, 1, 1, 1, 2])):
            vid = len(variables)
            kind = rng.choice([Kind.ACTIVATION, Kind.ACTIVATION, Kind.TEMPORARY, Kind.GRAD])
            nb = 0 if rng.random() < 0.03 else rng.randint(1, max_bytes)
            variables.append(Variable(vid, nb, kind, name=f"v{vid}", live_out=rng.random() < 0.1))
            uses.append((vid, "w"))
            if rng.random() < 0.2:
                uses.append((vid, "r"))  # read back in the op that wrote it
            existing.append(vid)
        functions.append((f"op{i}", uses, Cost(flops=float(rng.randint(0, 1000)))))
    return build_sequence(functions, variables)


@st.composite
def sequences(draw: Any, max_functions: int = 20, max_bytes: int = 100) -> VariableSequence:
    """Random valid sequences, shrinking towards short and simple ones."""
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    n = draw(st.integers(min_value=1, max_value=max_functions))
    return random_sequence(random.Random(seed), max_functions=n, max_bytes=max_bytes)


def training_like_sequence(
    layers: int,
    *,
    style: str = "cnn",
    act_bytes: int = 1 << 20,
    param_bytes: int = 1 << 16,
    optimizer: bool = True,
    grads_live_out: bool = False,
) -> VariableSequence:
    """A forward + backward + optimizer step with ``layers`` layers (deterministic).

    Forward, per layer ``l``: ``fwd{l}.a`` reads the previous output and ``w{l}``, writes
    ``a{l}`` (saved for the backward); ``fwd{l}.b`` (an activation function) reads ``a{l}``
    and writes ``h{l}`` (also saved). The transformer style adds an attention temporary
    ``s{l}`` (4x the activation) created and freed inside the block. Then a loss.
    Backward, in reverse: reads the incoming gradient, the saved ``h{l}``/``a{l}`` and the
    parameter, creates the parameter gradient ``gw{l}`` and the outgoing gradient.
    Optimizer: for each layer reads ``gw{l}``, updates ``w{l}`` (and ``m{l}``) in place.
    ``meta["backward_start"]`` marks the first backward function.
    """
    if style not in ("cnn", "transformer"):
        raise ValueError(f"style must be 'cnn' or 'transformer', got {style!r}")
    variables: list[Variable] = []
    fns: list[tuple[str, list[tuple[int, str]], Cost]] = []

    def new(nb: int, kind: Kind, name: str, **kw: bool) -> int:
        vid = len(variables)
        variables.append(Variable(vid, max(0, int(nb)), kind, name=name, **kw))
        return vid

    def act_size(l: int) -> int:
        if style == "transformer":
            return act_bytes
        stage = min(l * 4 // max(layers, 1), 3)      # four stages, halving the bytes each
        return max(1, act_bytes >> stage)

    def par_size(l: int) -> int:
        if style == "transformer":
            return param_bytes
        stage = min(l * 4 // max(layers, 1), 3)
        return max(1, param_bytes << (2 * stage))    # channels double: weights x4 per stage

    x = new(act_size(0), Kind.INPUT, "input", live_in=True)
    w = [new(par_size(l), Kind.PARAM, f"w{l}", live_in=True, live_out=True) for l in range(layers)]
    m = ([new(par_size(l), Kind.OPTIMIZER_STATE, f"m{l}", live_in=True, live_out=True) for l in range(layers)]
         if optimizer else [])
    a: list[int] = []
    h: list[int] = []
    prev = x
    for l in range(layers):
        nb = act_size(l)
        flops = float(nb * 8)
        if style == "transformer":
            s = new(4 * nb, Kind.TEMPORARY, f"s{l}")
            fns.append((f"fwd{l}.scores", [(prev, "r"), (w[l], "r"), (s, "w")], Cost(flops=flops)))
            al = new(nb, Kind.ACTIVATION, f"a{l}")
            fns.append((f"fwd{l}.a", [(s, "r"), (prev, "r"), (al, "w")], Cost(flops=flops)))
        else:
            al = new(nb, Kind.ACTIVATION, f"a{l}")
            fns.append((f"fwd{l}.a", [(prev, "r"), (w[l], "r"), (al, "w")], Cost(flops=flops)))
        hl = new(nb, Kind.ACTIVATION, f"h{l}")
        fns.append((f"fwd{l}.b", [(al, "r"), (hl, "w")], Cost(flops=flops / 8)))
        a.append(al)
        h.append(hl)
        prev = hl
    loss = new(4, Kind.ACTIVATION, "loss")
    fns.append(("loss", [(prev, "r"), (loss, "w")], Cost(flops=1.0)))
    backward_start = len(fns)
    g = new(act_size(layers - 1) if layers else 4, Kind.TEMPORARY, "dloss")
    fns.append(("loss.backward", [(loss, "r"), (g, "w")], Cost(flops=1.0)))
    gw: list[int] = [0] * layers
    for l in reversed(range(layers)):
        nb = act_size(l)
        flops = float(nb * 16)
        ga = new(nb, Kind.TEMPORARY, f"da{l}")
        fns.append((f"bwd{l}.b", [(g, "r"), (h[l], "r"), (a[l], "r"), (ga, "w")], Cost(flops=flops / 8)))
        src = x if l == 0 else h[l - 1]
        gw[l] = new(par_size(l), Kind.GRAD, f"gw{l}", live_out=grads_live_out)
        gin = new(act_size(l - 1) if l else act_size(0), Kind.TEMPORARY, f"dh{l - 1}")
        fns.append((f"bwd{l}.a", [(ga, "r"), (src, "r"), (w[l], "r"), (gw[l], "w"), (gin, "w")],
                    Cost(flops=flops)))
        g = gin
    for l in range(layers):
        uses = [(gw[l], "r"), (w[l], "r"), (w[l], "w")]
        if optimizer:
            uses += [(m[l], "r"), (m[l], "w")]
        fns.append((f"opt{l}", uses, Cost(flops=float(par_size(l)))))
    return build_sequence(fns, variables, meta={"backward_start": backward_start, "style": style})


@st.composite
def training_sequences(draw: Any, max_layers: int = 12) -> VariableSequence:
    """Training-like sequences with random depth, style and size ratios."""
    return training_like_sequence(
        draw(st.integers(min_value=1, max_value=max_layers)),
        style=draw(st.sampled_from(["cnn", "transformer"])),
        act_bytes=draw(st.integers(min_value=8, max_value=4096)),
        param_bytes=draw(st.integers(min_value=1, max_value=2048)),
        optimizer=draw(st.booleans()),
        grads_live_out=draw(st.booleans()),
    )
