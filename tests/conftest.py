"""Shared fixtures: the GPU marker's skip rule, the seeded generator, and the CUDA test switches."""
import contextlib
import os
import zlib

# every kernel Launch checks that its layout's parameters stay those of its first call
os.environ.setdefault("CUFLASH_CHECK_LAUNCHES", "1")

import numpy as np
import pytest


def _cuda_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or no device
        return False


HAS_GPU = _cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def override():
    """Sets cuflash's test switches until the test ends: ``override(path="split", poison=True)``
    (cuflash._gpu.override: forced path, NaN-poisoned outputs, wgmma tiles); repeated calls add
    to each other."""
    from cuflash import _gpu
    with contextlib.ExitStack() as stack:
        yield lambda **switches: stack.enter_context(_gpu.override(**switches))
