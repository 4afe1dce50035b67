"""Recording a training step as a ``scheduler.VariableSequence``: one recorder for
``ooc.trace`` (meta device) and the engine's recording step (for real).

- ``op_schema``: what an aten op's schema says about its tensors (computed once per op);
- ``storages``: storages as variables, the key and why it stays unique;
- ``recorder``: the per-op use rules, kinds and names (``StepRecorder``);
- ``trace_mode``, ``traced_step``, ``scopes``, ``copies``: what ``ooc.trace`` adds around it
  (a dispatch mode, the step on private copies, module scopes in function names);
- ``compare``: the canonical form two recordings of one step are compared in.
"""
