"""Test doubles. The FAKE cuda-python driver modules live in ``ooc.testing`` (shipped with the
package); ``tests.fakes.fake_cuda_driver`` and ``tests.fakes.fake_cuda_copies`` are aliases."""
