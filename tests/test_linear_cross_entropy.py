"""The fused linear cross-entropy against an fp64 full-logits reference: Triton kernels (interpreter on the CPU,
fp32) and the chunked torch path, odd shapes, every option, and bad input."""

import pytest
import torch

import lightning_slide.kernels.linear_cross_entropy as flce
from helpers import LargestTensor, kernel_path
from lightning_slide.kernels.linear_cross_entropy import (
    FusedLinearCrossEntropy,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)

N, H, V = 37, 19, 1001


@pytest.fixture(params=["triton", "torch"])
def path(request, tune):
    tune(flce, chunk_elements=N * 300, min_chunk_cols=1)  # 4 vocabulary chunks of 256 (the last one 233)
    return kernel_path(flce, request.param, tune)


@pytest.fixture(params=["two", "one"])
def passes(request, tune):
    """The two-pass vocabulary walk, or the one-pass token walk (in chunks of 10 tokens: 10, 10, 10, 7)."""
    tune(flce, one_pass=request.param == "one", one_pass_chunk_elements=10 * V, min_chunk_rows=1)
    return request.param


def _inputs(bias=True, ignore_every=5):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        target[::ignore_every] = -100
    return hidden, weight, b, target


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


ALONE = pytest.mark.slow  # each option alone: the default suite checks them together in the last case
OPTIONS = [
    {},
    pytest.param({"reduction": "sum"}, marks=ALONE),
    {"reduction": "none"},
    pytest.param({"label_smoothing": 0.1}, marks=ALONE),
    pytest.param({"z_loss": 1e-3}, marks=ALONE),
    pytest.param({"softcap": 3.0}, marks=ALONE),
    {"normalizer": 123.0},
    {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 10.0, "reduction": "sum"},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp64_reference(path, passes, options, bias):
    hidden, weight, b, target = _inputs(bias)
    leaves64 = [t.requires_grad_() for t in (hidden, weight, b) if t is not None]
    leaves32 = [t.detach().float().requires_grad_() for t in leaves64]
    h32, w32, b32 = leaves32[0], leaves32[1], leaves32[2] if bias else None
    ours = fused_linear_cross_entropy(h32, w32, target, b32, **options)
    ref = fused_linear_cross_entropy_ref(hidden, weight, target, b, **options)
    assert _rel(ours, ref) < 1e-5
    grad_out = torch.randn_like(ref) if ref.dim() else torch.tensor(1.7, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, leaves32, grad_out.float())
    ref_grads = torch.autograd.grad(ref, leaves64, grad_out)
    for name, mine, expected in zip(("hidden", "weight", "bias"), ours_grads, ref_grads):
        assert _rel(mine, expected) < 1e-5, name


def test_all_ignored_gives_zero_loss_and_zero_gradients(path, passes):
    hidden, weight, _, target = _inputs(bias=False)
    target[:] = -100
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, target)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.abs().max().item() == 0.0
    assert w.grad.abs().max().item() == 0.0


def test_no_tokens_gives_zero_loss_and_zero_gradients(path, passes):
    _, weight, _, _ = _inputs(bias=False)
    h, w = torch.zeros(0, H, requires_grad=True), weight.float().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.shape == (0, H)
    assert w.grad.abs().max().item() == 0.0


def test_per_token_correctness(path, passes):
    hidden, weight, _, target = _inputs(bias=False)
    target[1] = (hidden[1] @ weight.t()).argmax()  # at least one token right
    _, correct = fused_linear_cross_entropy(hidden.float(), weight.float(), target, return_correct=True)
    expected = ((hidden @ weight.t()).argmax(-1) == target) & (target != -100)
    assert torch.equal(correct, expected)
    assert correct[1]


def test_int32_targets_and_module_form(path):
    hidden, weight, _, target = _inputs(bias=False)
    loss = FusedLinearCrossEntropy(label_smoothing=0.05)(hidden.float(), weight.float(), target.int())
    ref = fused_linear_cross_entropy_ref(hidden, weight, target, label_smoothing=0.05)
    assert _rel(loss, ref) < 1e-5


def test_never_builds_full_logits(path, passes):
    hidden, weight, _, target = _inputs(bias=False)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with LargestTensor() as watch:
        fused_linear_cross_entropy(h, w, target).backward()
    # one chunk of fp32 logits (256 columns, or 10 tokens), or the weight gradient itself
    assert watch.largest <= 4 * max(N * 256, 10 * V, V * H)
    assert watch.largest < 4 * N * V


def test_a_retained_graph_keeps_the_gradients_and_a_plain_backward_frees_them(passes):
    # the one pass keeps its gradients as saved tensors, scaled in place only by a backward that frees the graph
    hidden, weight, b, target = _inputs(bias=True)
    leaves = [t.float().requires_grad_() for t in (hidden, weight, b)]
    loss = fused_linear_cross_entropy(*leaves[:2], target, leaves[2])
    first = torch.autograd.grad(3.0 * loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, c in zip(first, second):
        torch.testing.assert_close(a, 3.0 * c)
    with pytest.raises(RuntimeError, match="freed"):
        loss.grad_fn.saved_tensors


def test_one_pass_sums_the_weight_gradient_over_at_most_max_token_chunks(monkeypatch, tune):
    # a budget of 1 logit per chunk would make 37 chunks of one token; max_token_chunks=3 makes them 13, 13, 11
    chunks = []
    fold = flce.fold_lse_and_grad
    monkeypatch.setattr(flce, "fold_lse_and_grad", lambda x, *a: chunks.append(x.shape[0]) or fold(x, *a))
    tune(flce, one_pass=True, one_pass_chunk_elements=1, min_chunk_rows=1, max_token_chunks=3)
    hidden, weight, _, target = _inputs(bias=False)
    leaves = [t.float().requires_grad_() for t in (hidden, weight)]
    grads = torch.autograd.grad(fused_linear_cross_entropy(*leaves, target), leaves)
    ref = torch.autograd.grad(fused_linear_cross_entropy_ref(hidden.requires_grad_(), weight.requires_grad_(),
                                                             target), (hidden, weight))  # fmt: skip
    assert chunks == [13, 13, 11]
    for mine, expected in zip(grads, ref):
        assert _rel(mine, expected) < 1e-5


def test_bf16_weight_gradient_over_token_chunks_within_twice_plain_bf16(tune):
    # the torch path on the CPU, bf16: the weight gradient rounded once per token chunk, 4 here (8 read 2.01x plain at
    # this small shape; the GPU test below takes the default 8 at 8k and 32k tokens)
    import torch.nn.functional as F

    tune(flce, triton=False, one_pass=True, one_pass_chunk_elements=1, min_chunk_rows=1, max_token_chunks=4)
    n, h, v = 2048, 256, 4096
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.02).bfloat16()
    target = torch.randint(0, v, (n,), generator=g)

    def weight_grad(fn, a, b):
        b = b.detach().requires_grad_()
        return torch.autograd.grad(fn(a, b), b)[0]

    ref = weight_grad(lambda a, b: F.cross_entropy(F.linear(a, b), target), hidden.double(), weight.double())
    plain = weight_grad(lambda a, b: F.cross_entropy(F.linear(a, b).float(), target), hidden, weight)
    ours = weight_grad(lambda a, b: fused_linear_cross_entropy(a, b, target), hidden, weight)
    assert ours.dtype == torch.bfloat16
    assert _rel(ours, ref) <= 2 * _rel(plain, ref), (_rel(ours, ref), _rel(plain, ref))


@pytest.mark.parametrize("one_pass", [True, False])
def test_one_pass_argument_chooses_the_walk(monkeypatch, tune, one_pass):
    calls = []
    walk = flce.flce_one_pass
    monkeypatch.setattr(flce, "flce_one_pass", lambda *a: calls.append(1) or walk(*a))
    tune(flce, one_pass=not one_pass)  # the opposite of the argument
    hidden, weight, _, target = _inputs(bias=False)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    fused_linear_cross_entropy(h, w, target, one_pass=one_pass).backward()
    assert bool(calls) == one_pass


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden": torch.randn(N, H + 1)}, "same H"),
        ({"hidden": torch.randn(N, H).int()}, "floating point"),
        ({"target": torch.zeros(N + 1, dtype=torch.long)}, "target must be"),
        ({"target": torch.zeros(N)}, "target must be"),
        ({"bias": torch.randn(V + 1)}, "bias must be"),
        ({"reduction": "avg"}, "reduction must be"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"z_loss": -1.0}, "z_loss"),
        ({"softcap": 0.0}, "softcap"),
        ({"reduction": "none", "normalizer": 3.0}, "normalizer"),
        ({"reduction": "none", "one_pass": True}, "one_pass"),
    ],
)
def test_bad_input_names_the_argument(change, match):
    hidden, weight, _, target = _inputs(bias=False)
    kwargs = {"hidden": hidden.float(), "weight": weight.float(), "target": target, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        fused_linear_cross_entropy(**kwargs)


def test_out_of_range_target_is_caught_on_cpu():
    hidden, weight, _, target = _inputs(bias=False)
    target[7] = V
    with pytest.raises(ValueError, match=r"target\[7\] = 1001 is outside \[0, 1001\)"):
        fused_linear_cross_entropy(hidden.float(), weight.float(), target)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "v"), [(8192, 128256), (32768, 32000)])  # 32k x 128k ran out of 80 GB
@pytest.mark.parametrize("one_pass", [False, True], ids=["two-pass", "one-pass"])
@pytest.mark.parametrize("triton_on_cuda", [True, False], ids=["triton", "torch"])
def test_cuda_bf16_error_within_twice_plain_bf16(tune, triton_on_cuda, one_pass, n, v):
    import torch.nn.functional as F

    tune(flce, triton=triton_on_cuda, one_pass=one_pass)  # 8 token chunks: 1024 tokens each at 8k, 4096 at 32k
    h = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    target[::7] = -100

    def run(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        loss = fn(*leaves)
        return (loss.detach().float(), *torch.autograd.grad(loss, leaves))

    ref = run(lambda a, b: fused_linear_cross_entropy_ref(a, b, target), hidden.float(), weight.float())
    plain = run(lambda a, b: F.cross_entropy(F.linear(a, b).float(), target), hidden, weight)
    ours = run(lambda a, b: fused_linear_cross_entropy(a, b, target), hidden, weight)
    for name, p, o, r in zip(("loss", "dx", "dW"), plain, ours, ref):
        plain_err, our_err = _rel(p.float(), r.double()), _rel(o.float(), r.double())
        assert our_err <= 2 * plain_err + 1e-6, f"{name}: ours {our_err:.2e} vs plain bf16 {plain_err:.2e}"


@pytest.mark.gpu
def test_cuda_one_pass_takes_the_workspace_the_planner_counts():
    # 8k tokens, a 128k x 4096 bf16 head: the extra memory of forward + backward, gradients included (1.29 GiB)
    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    target = torch.randint(0, v, (n,), device="cuda")

    def step():
        leaves = [t.detach().requires_grad_() for t in (hidden, weight)]
        return torch.autograd.grad(fused_linear_cross_entropy(*leaves, target), leaves)

    step()  # autotuning and its buffers outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = step()
    extra = torch.cuda.max_memory_allocated() - base
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert extra <= flce.workspace_bytes(n, v, h, 2, one_pass=True) + (16 << 20), extra / 2**30
    assert extra <= 1.3 * 2**30, extra / 2**30


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_scaling_of_the_one_pass_gradients_rounds_once(dtype):
    # the backward's kernel: the product in fp32, rounded once (torch's mul by a 0-dim tensor would round the factor
    # to the gradient's dtype first), in place and into a new tensor
    from lightning_slide.kernels.cross_entropy_chunk import scale_into

    g = torch.randn(4097, 33, device="cuda").to(dtype)
    factor = torch.tensor(1 / 3, device="cuda")
    expected = (g.float() * factor).to(dtype)
    assert torch.equal(scale_into(g, factor, torch.empty_like(g)), expected)
    assert torch.equal(scale_into(g, factor, g), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("room", [0, 1 << 40])
def test_cuda_one_pass_only_where_the_gpu_has_room(monkeypatch, room):
    calls = []
    walk = flce.flce_one_pass
    monkeypatch.setattr(flce, "flce_one_pass", lambda *a: calls.append(1) or walk(*a))
    monkeypatch.setattr(flce, "device_room", lambda device: room)
    n, h, v = 4096, 256, 1000
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    fused_linear_cross_entropy(hidden, weight, target).backward()
    assert bool(calls) == (room > 0)
