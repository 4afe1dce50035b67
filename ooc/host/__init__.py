"""What ooc changes in the whole process, apart from the step code: the recycling CPU
allocator (``cpu_allocator.py``, built from ``cpu_allocator.cpp``), glibc's malloc settings
(``malloc.py``), and ``process_effects.py``, which applies them at an engine's first step and
undoes them at ``close()`` or collection. Kept apart because they outlive any one step and
reach every tensor of the process, not only the engine's."""
