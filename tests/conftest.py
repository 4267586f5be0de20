"""Test configuration: the GPU marker, Triton's interpreter on CPU-only machines, a fixed seed for every test, and
the kernels' tuning for a test."""

import contextlib
import os
import warnings

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU under the interpreter (set before any kernel module is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def tune():
    """``tune(kernel_module, **changes)``: the kernel module's ``tuning(**changes)`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda module, **changes: stack.enter_context(module.tuning(**changes))
