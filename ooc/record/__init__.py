"""Recording a training step as a ``scheduler.VariableSequence``: one recorder for
``ooc.trace`` (meta device) and the engine's recording step (for real), keyed the same way.

- ``op_schema``: what an aten op's schema says about its tensors (computed once per op; the
  runtime's per-op path reads it too);
- ``storages``: storages as variables, the key and why it stays unique;
- ``recorder``: the per-op use rules and the variables they make (``StepRecorder``);
- ``replay``: which functions a plan may recompute (``replayable``, ``rng``,
  ``updates_stats``), per op from its schema and tags;
- ``roles``: parameters, buffers, optimizer state and gradients, told to the recorder the
  same way by both drivers;
- ``managed``: the view of a step the engine plans from (managed tensors only);
- ``trace_mode``, ``traced_step``, ``scopes``, ``copies``: what ``ooc.trace`` adds around the
  recorder (a dispatch mode, the step on private copies, module scopes in function names);
- ``compare``: the canonical form two recordings of one step are compared in.
"""
