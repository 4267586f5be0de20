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


@pytest.fixture(autouse=True)
def _loss_path(request):
    """Under the interpreter, the loss kernel's Triton path takes ~0.4 s a training step of the tiny models: tests of
    anything else run its torch path (the same algorithm, and what a CPU run takes without the interpreter). Its own
    tests, and tests marked ``triton_loss``, keep the Triton path."""
    import lightning_slide.kernels.linear_cross_entropy as flce

    kept = request.node.get_closest_marker("triton_loss") or request.module.__name__.endswith("linear_cross_entropy")
    if not flce._INTERPRET or kept:
        yield
        return
    with flce.tuning(triton=False):
        yield


@pytest.fixture
def tune():
    """``tune(kernel_module, **changes)``: the kernel module's ``tuning(**changes)`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda module, **changes: stack.enter_context(module.tuning(**changes))
