"""The fused RMSNorm and rotary kernels against Hugging Face's formulas, what they take over, and training with them."""

import lightning as L
import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaConfig, GemmaMLP, GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

from helpers import CausalLM, fit, relative_update, tiny_config, token_data
from lightning_slide import SlideFormerStrategy, fused
from lightning_slide.kernels import norm as kernel_module
from lightning_slide.kernels.norm import rms_norm, rms_norm_ref
from lightning_slide.kernels.rotary import rotary_embedding, rotary_embedding_ref, rotary_on_kernel
from lightning_slide.kernels.swiglu import swiglu, swiglu_ref

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
def test_norm_kernel_matches_the_formula_forward_and_backward(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator) * 0.5 + 1
    dy = torch.randn(shape, generator=generator)
    for got, want in zip(_grads(rms_norm, x, weight, dy), _grads(rms_norm_ref, x, weight, dy), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_norm_kernel_takes_strided_inputs_and_a_frozen_weight():
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
    restore = fused.use_fused_rms_norm(model)
    assert type(model["llama"]).forward is fused._fused_forward
    assert {name: type(m) for name, m in model.items() if name != "llama"} == {
        name: cls for name, cls in before.items() if name != "llama"
    }
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(model["llama"](x), rms_norm_ref(x, model["llama"].weight, 1e-6))
    restore()
    assert {name: type(m) for name, m in model.items()} == before
    assert fused.use_fused_rms_norm(nn.ModuleDict({"gemma": GemmaRMSNorm(16)})) is None


@interpreted
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_training_with_the_fused_ops_equals_plain_lightning(family, monkeypatch):
    # Qwen3 also normalizes each head's queries and keys (q_norm, k_norm): those run on the kernel too
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    file = {"llama": modeling_llama, "qwen3": modeling_qwen3}[family]
    original = file.apply_rotary_pos_emb
    norm_widths, rotations = [], []
    monkeypatch.setattr(fused, "rms_norm", lambda *a: norm_widths.append(a[0].shape[-1]) or rms_norm(*a))
    monkeypatch.setattr(fused, "rotary_on_kernel", lambda *a: rotations.append(a[0].shape) or rotary_on_kernel(*a))
    gates = []
    monkeypatch.setattr(fused, "swiglu", lambda g, u: gates.append(g.shape) or swiglu(g, u))
    switched = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            norms = sum(type(m).forward is fused._fused_forward for m in pl_module.modules())
            mlps = sum(type(m).forward is fused._fused_mlp_forward for m in pl_module.modules())
            switched.append((norms, mlps, file.apply_rotary_pos_emb is not original))

    # SGD: the trained weights carry the kernels' rounding linearly, where Adam's first steps would take the sign of
    # near-zero gradients (Qwen3's layer-0 gate_proj moved 1e-5 from float64 with these kernels, 6e-7 in plain fp32,
    # 5e-6 streamed without them, while its gradient was as close to float64 with them: 4.0e-7 against 3.7e-7)
    module = CausalLM(tiny_config(family), optimizer="sgd", lr=0.1)
    start = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    data = token_data(n=8, seq=6)  # short rows: the interpreter runs a kernel row by row
    ref, _ = fit(module, "auto", steps=2, data=data)
    strategy = SlideFormerStrategy(num_slots=2, fused_ops=True)
    ours, trained = fit(module, strategy, steps=2, data=data, callbacks=[Look()])
    norms_per_model = 4 * (2 + 2 * (family == "qwen3")) + 1
    assert switched == [(norms_per_model, 4, True)] * 2
    assert len(set(norm_widths)) == 1 + (family == "qwen3")  # hidden width, and the head width for q_norm/k_norm
    assert len(rotations) >= 2 * 4 * 2  # queries and keys of 4 blocks, 2 steps (and the recomputes)
    assert len(gates) >= 4 * 2
    assert not any(type(m).forward in (fused._fused_forward, fused._fused_mlp_forward) for m in trained.modules())
    assert file.apply_rotary_pos_emb is original
    assert relative_update(ours, ref, start) < 1e-5  # 3e-7 measured; a 0.1 % error in the gate's gradient gives 8e-5


@interpreted
@pytest.mark.parametrize(("heads_first", "cos_batch"), [(True, 2), (True, 1), (False, 2)])
def test_rotary_kernel_matches_the_formula_forward_and_backward(heads_first, cos_batch):
    # queries as transformers makes them: (batch, seq, heads, dim) projections, viewed heads first (strided)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 16, generator=generator)
    x = (x.transpose(1, 2) if heads_first else x).requires_grad_()
    cos, sin = (torch.randn(cos_batch, 7, 16, generator=generator) for _ in range(2))
    dim = 1 if heads_first else 2
    y = rotary_embedding(x, cos, sin, dim)
    dy = torch.randn(y.shape, generator=generator)
    y.backward(dy)
    grad, x.grad = x.grad, None
    want = rotary_embedding_ref(x, cos, sin, dim)
    want.backward(dy)
    assert y.stride() == want.stride()  # the layout transformers' ops give
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, x.grad, rtol=1e-6, atol=1e-6)


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J's rotary: pairs of neighbours, not halves: the probe must keep it."""

    def turn(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + turn(q) * sin, k * cos + turn(k) * sin


def _with_sections(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    return q, k


def _hidden(default_dim):
    """Llama's rotary behind ``(*args, **kwargs)``, as Hugging Face's ``kernels`` wraps transformers' functions."""

    def apply_rotary_pos_emb(*args, **kwargs):
        q, k, cos, sin = args
        dim = kwargs.get("unsqueeze_dim", default_dim)
        return rotary_embedding_ref(q, cos, sin, dim), rotary_embedding_ref(k, cos, sin, dim)

    return apply_rotary_pos_emb


def test_only_llamas_rotary_is_switched_and_a_partial_rotary_takes_the_original():
    from transformers.models.llama import modeling_llama

    llama = modeling_llama.apply_rotary_pos_emb
    assert fused._llama_rotary_dim(llama) == 1
    assert fused._llama_rotary_dim(_interleaved) is None
    assert fused._rotary_default_dims(_with_sections) == ()  # a required argument past (q, k, cos, sin)
    for dim in (1, 2):
        assert fused._rotary_default_dims(_hidden(dim)) == (1, 2)
        assert fused._llama_rotary_dim(_hidden(dim)) == dim
    calls = []
    switched = fused._fused_rotary(lambda *a, **k: calls.append(k) or llama(*a, **k), 1)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    narrow = [torch.randn(1, 5, 4) for _ in range(2)]  # cos and sin of a partial rotary: narrower than the head
    with pytest.raises(RuntimeError):  # Llama's formula cannot take them either: the call reached the original
        switched(q, k, *narrow)
    assert calls == [{"unsqueeze_dim": 1}]


@interpreted
@pytest.mark.parametrize("shape", [(2, 9, 40), (3, 1100)])  # the second crosses a program's block of elements
def test_swiglu_kernel_matches_the_formula_forward_and_backward(shape):
    generator = torch.Generator().manual_seed(2)
    gate, up, dy = (torch.randn(shape, generator=generator, dtype=torch.float64) * 3 for _ in range(3))

    def run(fn, dtype):
        g, u = gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()
        y = fn(g, u)
        y.backward(dy.to(dtype))
        return y, g.grad, u.grad

    for got, want in zip(run(swiglu, torch.float32), run(swiglu_ref, torch.float64), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _tiny(config_class):
    return config_class(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2)


class ScaledMLP(LlamaMLP):
    """A gated MLP that differs from Llama's formula (a factor of two): the probe must keep its forward."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_only_swiglu_mlps_are_switched_and_restored():
    # Gemma's MLP has the same projections with a GELU: the probe tells it apart, as it does a changed forward
    model = nn.ModuleDict(
        {
            "llama": LlamaMLP(_tiny(LlamaConfig)),
            "gemma": GemmaMLP(_tiny(GemmaConfig)),
            "scaled": ScaledMLP(_tiny(LlamaConfig)),
        }
    )
    before = {name: type(m) for name, m in model.items()}
    x = torch.randn(2, 5, 16)
    expected = model["llama"](x)
    restore = fused.use_fused_swiglu(model)
    assert type(model["llama"]).forward is fused._fused_mlp_forward
    assert {name: type(m) for name, m in model.items() if name != "llama"} == {
        name: cls for name, cls in before.items() if name != "llama"
    }
    torch.testing.assert_close(model["llama"](x), expected)  # the kernel (interpreted here) within fp32 rounding
    restore()
    assert {name: type(m) for name, m in model.items()} == before


def test_fused_ops_refuses_a_bad_value():
    with pytest.raises(ValueError, match="fused_ops must be True, False or 'auto'"):
        SlideFormerStrategy(fused_ops="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [128, 4096, 5120])
def test_norm_kernel_on_cuda_within_twice_the_formulas_error(dtype, width):
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_kernel_on_cuda_within_twice_the_formulas_error(dtype):
    # Llama-3.1-8B's queries for 2 x 4096 tokens, heads first as transformers views them; cos/sin in fp32
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4096, 32, 128, device="cuda", generator=generator).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(1, 4096, 128, device="cuda", generator=generator) for _ in range(2))
    dy = torch.randn(x.shape, device="cuda", generator=generator)

    def run(fn, x):
        x = x.detach().requires_grad_()
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # cos/sin of the fp32 residual stream
        y = fn(x, cos.to(wide), sin.to(wide))
        y.backward(dy.to(y.dtype))
        return y.double(), x.grad.double()

    exact = run(rotary_embedding_ref, x.double())
    ours, plain = run(rotary_embedding, x), run(rotary_embedding_ref, x)
    for name, got, formula, want in zip(("y", "dx"), ours, plain, exact, strict=True):
        e_ours, e_plain = ((got - want).norm() / want.norm()).item(), ((formula - want).norm() / want.norm()).item()
        assert e_ours <= 2 * e_plain + 1e-6, f"{name}: {e_ours:.2e} against the formula's {e_plain:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_kernel_on_cuda_within_twice_the_formulas_error(dtype):
    # the gate and up projections of 4096 tokens of Llama-3.1-8B's MLP (intermediate 14336)
    generator = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(4096, 14336, device="cuda", generator=generator) * 2 for _ in range(2))
    dy = torch.randn(4096, 14336, device="cuda", generator=generator)

    def run(fn, dtype):
        g, u = gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()
        y = fn(g, u)
        y.backward(dy.to(dtype))
        return [t.double() for t in (y, g.grad, u.grad)]

    exact = run(swiglu_ref, torch.float64)
    for name, got, formula, want in zip(("y", "dgate", "dup"), run(swiglu, dtype), run(swiglu_ref, dtype), exact):
        e_ours, e_plain = ((got - want).norm() / want.norm()).item(), ((formula - want).norm() / want.norm()).item()
        assert e_ours <= 2 * e_plain + 1e-6, f"{name}: {e_ours:.2e} against the formula's {e_plain:.2e}"


class CastAtTheEndRMSNorm(LlamaRMSNorm):
    """DeepSeek-V4's variant: the weight multiplies in fp32 and the output takes the input's dtype. Equal to Llama's
    in fp32 and for bf16 weights within rounding; only a bf16 input with an fp32 weight tells them apart."""

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))).to(
            hidden_states.dtype
        )


def test_the_norm_probe_tells_a_variant_apart_by_its_mixed_precision_output():
    assert fused.use_fused_rms_norm(nn.ModuleDict({"v4": CastAtTheEndRMSNorm(16)})) is None
