"""Random initialisation drawn on the GPU for weights made on the CPU, so a seeded run starts where plain Lightning's
does.

Plain Lightning builds a model under ``torch.device(<the GPU>)``: a random init (``nn.Linear``'s reset, Hugging Face's
``_init_weights``) comes from the CUDA generator. The strategy builds the fp32 masters on the CPU, where the same calls
would draw from the CPU generator: other weights for the same seed. Each random fill of a CPU tensor is run on a GPU
tensor of its shape instead (the same draws, in the same order, as plain Lightning's) and copied down.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# By name: torch.nn.init's fills reach a mode as the function its module holds at the time, which transformers
# replaces with wrappers of its own while it builds a model; Tensor methods reach it as methods.
_FILLS = frozenset(
    {
        "normal_",
        "uniform_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "trunc_normal_",
        "orthogonal_",
        "sparse_",
        "log_normal_",
        "exponential_",
        "cauchy_",
        "geometric_",
        "random_",
    }
)


class DrawOnDevice(TorchFunctionMode):
    """Inside this mode, a random fill of a CPU tensor (with the default generator) is drawn on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = kwargs["tensor"] if "tensor" in kwargs else args[0] if args else None
        if (
            getattr(func, "__name__", None) not in _FILLS
            or not isinstance(target, torch.Tensor)
            or target.device.type != "cpu"
            or kwargs.get("generator") is not None
            or getattr(target, "_is_hf_initialized", False)  # transformers' fills leave it as it is
        ):
            return func(*args, **kwargs)
        drawn = torch.empty_like(target, device=self.device)
        self._fill(func, drawn, args[1:], {k: v for k, v in kwargs.items() if k != "tensor"})
        with torch.no_grad():
            return target.copy_(drawn)

    @staticmethod
    def _fill(func, drawn: torch.Tensor, args: tuple, kwargs: dict) -> None:
        func(drawn, *args, **kwargs)
