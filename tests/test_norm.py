"""The fused RMSNorm kernel against Hugging Face's formula, which modules it takes over, and training with it."""

import lightning as L
import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from helpers import CausalLM, fit, max_rel_error, tiny_config
from lightning_slide import SlideFormerStrategy, norms
from lightning_slide.kernels import norm as kernel_module
from lightning_slide.kernels import rms_norm, rms_norm_ref

interpreted = pytest.mark.skipif(
    not kernel_module._INTERPRET, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1"
)


def _grads(fn, x, weight, dy):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = fn(x, weight, 1e-6)
    y.backward(dy)
    return y, x.grad, weight.grad


@interpreted
@pytest.mark.parametrize("shape", [(2, 9, 96), (7, 128), (2, 3, 5, 24)])
def test_kernel_matches_the_formula_forward_and_backward(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator) * 0.5 + 1
    dy = torch.randn(shape, generator=generator)
    for got, want in zip(_grads(rms_norm, x, weight, dy), _grads(rms_norm_ref, x, weight, dy), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_kernel_takes_strided_inputs_and_a_frozen_weight():
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 40, generator=generator)[:, :32]).requires_grad_()  # rows of stride 40
    weight = torch.randn(32, generator=generator)  # no gradient wanted, as for a frozen base model's norm
    y = rms_norm(x, weight, 1e-5)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    rms_norm_ref(x, weight, 1e-5).sum().backward()
    torch.testing.assert_close(y, rms_norm_ref(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)


class ScaledRMSNorm(LlamaRMSNorm):
    """A norm that differs from Llama's formula (a factor of two): the probe must keep its forward."""

    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


def test_only_modules_that_follow_llamas_formula_are_switched_and_restored():
    model = nn.ModuleDict(
        {"llama": LlamaRMSNorm(16), "gemma": GemmaRMSNorm(16), "scaled": ScaledRMSNorm(16), "layer": nn.LayerNorm(16)}
    )
    before = {name: type(m) for name, m in model.items()}
    restore = norms.use_fused_rms_norm(model)
    assert type(model["llama"]).forward is norms._fused_forward
    assert {name: type(m) for name, m in model.items() if name != "llama"} == {
        name: cls for name, cls in before.items() if name != "llama"
    }
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(model["llama"](x), rms_norm_ref(x, model["llama"].weight, 1e-6))
    restore()
    assert {name: type(m) for name, m in model.items()} == before
    assert norms.use_fused_rms_norm(nn.ModuleDict({"gemma": GemmaRMSNorm(16)})) is None


@interpreted
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_training_with_the_fused_norm_equals_plain_lightning(family, monkeypatch):
    # Qwen3 also normalizes each head's queries and keys (q_norm, k_norm): those run on the kernel too
    calls = []
    monkeypatch.setattr(norms, "rms_norm", lambda *a: calls.append(a[0].shape[-1]) or rms_norm(*a))
    switched = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            switched.append(sum(type(m).forward is norms._fused_forward for m in pl_module.modules()))

    module = CausalLM(tiny_config(family))
    ref, _ = fit(module, "auto", steps=3)
    ours, trained = fit(module, SlideFormerStrategy(num_slots=2, fused_norm=True), steps=3, callbacks=[Look()])
    norms_per_model = 4 * (2 + 2 * (family == "qwen3")) + 1
    assert switched == [norms_per_model] * 3
    assert len(set(calls)) == 1 + (family == "qwen3")  # hidden width, and the head width for q_norm/k_norm
    assert not any(type(m).forward is norms._fused_forward for m in trained.modules())
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_fused_norm_refuses_a_bad_value():
    with pytest.raises(ValueError, match="fused_norm must be True, False or 'auto'"):
        SlideFormerStrategy(fused_norm="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [128, 4096, 5120])
def test_kernel_on_cuda_within_twice_the_formulas_error(dtype, width):
    # the input as the residual stream (fp32) or a projection (bf16) gives it, the weight in fp32 as the engine keeps
    # vectors; errors against the formula in fp64 without the rounding step
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4096, width, device="cuda", generator=generator) * 3).to(dtype)
    weight = torch.randn(width, device="cuda", generator=generator) * 0.5 + 1
    dy = torch.randn(4096, width, device="cuda", generator=generator)
    exact = [t.detach() for t in _grads(lambda x, w, eps: rms_norm_ref(x.double(), w.double(), eps), x, weight, dy)]

    def errors(fn):
        return [
            ((got.double() - want).norm() / want.norm()).item() for got, want in zip(_grads(fn, x, weight, dy), exact)
        ]

    ours, plain = errors(rms_norm), errors(rms_norm_ref)
    for name, e_ours, e_plain in zip(("y", "dx", "dw"), ours, plain, strict=True):
        assert e_ours <= 2 * e_plain + 1e-6, f"{name}: {e_ours:.2e} against the formula's {e_plain:.2e}"
