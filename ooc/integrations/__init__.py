"""One line that puts a framework's training loop under ``OutOfCore``.

- ``ooc.integrations.transformers.out_of_core(trainer, budget=...)``: Hugging Face ``Trainer``.
- ``ooc.integrations.lightning.OutOfCoreCallback(budget=...)``: a Lightning ``Callback``.

Each opens an ``engine.step()`` before the first forward of an optimizer step (its
micro-batches of gradient accumulation included) and closes it after that step's update, at
the framework's own hooks; the engine is made when the framework's model and optimizer exist
and closed when training ends. Importing ``ooc`` (or this package) imports neither framework:
only the module of the one you use does.
"""
