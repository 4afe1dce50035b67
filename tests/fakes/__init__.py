"""Test doubles. ``fake_cuda_driver`` is a FAKE cuda-python driver module (no GPU)."""
