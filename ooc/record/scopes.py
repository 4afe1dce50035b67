"""Which module an op belongs to, for function names (``"layer1.0.conv1:aten.convolution.default"``)."""

from __future__ import annotations

import bisect
from typing import Any, Callable

import torch
from torch import nn


class ModuleScopes:
    """Which module an op belongs to.

    Forward: module pre/post hooks keep a stack of module paths. Each autograd node gets a
    sequence number when the forward creates it (monotonic per thread), so the hooks also
    log (first sequence number, module path) change points; in the backward the node
    running the op (``torch._C._current_autograd_node()``) is looked up there. Gradient
    accumulation nodes have no number of their own (they hold the parameter instead).
    Only forward hooks are used: module *backward* hooks wrap outputs in an extra autograd
    function, which changes the ops and breaks in-place ReLU.
    """

    def __init__(self, model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        self._stack: list[str] = []
        self._outside = "model"
        self._points: list[int] = []
        self._paths: list[str] = []
        self._param_path = {id(p): (n.rpartition(".")[0] or "model") for n, p in params}
        self._handles: list[Any] = []
        self._seq = torch._C._autograd._get_sequence_nr
        self._node = torch._C._current_autograd_node
        for path, module in model.named_modules():
            label = path or "model"
            self._handles.append(module.register_forward_pre_hook(self._pre(label)))
            self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def _pre(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(label)
            self._change(label)
        return hook

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stack.pop()
        self._change(self._stack[-1] if self._stack else self._outside)

    def _change(self, label: str) -> None:
        self._points.append(self._seq())
        self._paths.append(label)

    def enter(self, label: str) -> None:
        """Ops outside any module are now part of ``label`` (``"loss"``)."""
        self._stack = []
        self._outside = label
        self._change(label)

    def forward(self) -> str:
        return self._stack[-1] if self._stack else self._outside

    def backward(self) -> str:
        node = self._node()
        if node is None:
            return "backward"
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad
            return self._param_path.get(id(variable), "backward")
        i = bisect.bisect_right(self._points, node._sequence_nr()) - 1
        return self._paths[i] if i >= 0 else "backward"

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

