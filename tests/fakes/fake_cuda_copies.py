"""The FAKE CUDA driver ships with the package (``ooc.testing.fake_cuda_copies``) so that users can dry-run
the CUDA path without a GPU; this module is that one, kept for the tests' old import path."""

import sys

from ooc.testing import fake_cuda_copies as _fake

sys.modules[__name__] = _fake
