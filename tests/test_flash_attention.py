"""The flash attention kernels against an fp64 reference: Triton (interpreter on the CPU, fp32) and the torch path,
dense and packed, GQA, causal, non-causal and sliding window, forward and all three gradients; bad input."""

import pytest
import torch
import triton

import lightning_slide.kernels.attention as fa
import lightning_slide.kernels.attention_triton as programs
from helpers import kernel_path
from lightning_slide.kernels.attention import FlashAttention, flash_attention, flash_attention_ref

CU = torch.tensor([0, 5, 20, 37], dtype=torch.int32)
MASKS = pytest.mark.parametrize(
    ("causal", "window"), [(True, None), (False, None), (True, 7)], ids=["causal", "full", "window"]
)


@pytest.fixture(params=["triton", "torch"])
def path(request, tune):
    return kernel_path(fa, request.param, tune)


def _qkv(packed: bool, d: int, hq: int = 4, hkv: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lead = (37,) if packed else (2, 37)
    return [torch.randn(*lead, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@MASKS
@pytest.mark.parametrize(("d", "hkv"), [(16, 2), (32, 1)], ids=["d16-gqa", "d32-mqa"])
def test_matches_fp64_reference(path, packed, causal, window, d, hkv):
    cu = CU if packed else None
    _assert_matches_reference(*_qkv(packed, d, hkv=hkv), causal=causal, window=window, cu_seqlens=cu)


def _assert_matches_reference(q, k, v, **kwargs):
    # fp64 q, k, v: the output and the three gradients in fp32 against the fp64 reference's
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = flash_attention_ref(q, k, v, **kwargs)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **kwargs)
    assert out.shape == q.shape
    assert _rel(out, ref) < 1e-5
    grad = torch.randn_like(ref)
    ours = torch.autograd.grad(out, leaves, grad.float())
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", ours, expected):
        assert _rel(a, b) < 1e-5, f"d{name}"


TMA = pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("walk", ["by-query-head", "group-one-loop", "group-loop-per-head"])
@TMA
def test_dkdv_walks_match_fp64_reference(tune, packed, walk, tma):
    # dK/dV run one program per query head and sum the group's partial sums afterwards (few key blocks), or one
    # program per kv head, whose group of query heads shares one loop (few query blocks) or has a loop each
    kernel_path(fa, "triton", tune)
    split_below = 1 << 30 if walk == "by-query-head" else 0
    tune(fa, split_below=split_below, flat_below=1 << 20 if walk == "group-one-loop" else 0, tma=tma)
    _assert_matches_reference(*_qkv(packed, 16, hq=4, hkv=2), causal=True, window=7, cu_seqlens=CU if packed else None)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize(  # MASKS; without a mask (test_matches_fp64_reference's in the default suite): slow
    ("causal", "window"),
    [(True, None), pytest.param(False, None, marks=pytest.mark.slow), (True, 7)],
    ids=["causal", "full", "window"],
)
@pytest.mark.parametrize(
    ("hq", "pack_gqa"), [(8, 8), (8, 1), (6, 8)], ids=["group4-together", "group4-by-head", "group3"]
)
def test_query_heads_per_program_match_fp64_reference(tune, packed, causal, window, hq, pack_gqa):
    # the forward and dQ programs hold a group's query heads together (a power of two up to pack_gqa) or one each
    kernel_path(fa, "triton", tune)
    tune(fa, pack_gqa=pack_gqa)
    cu = CU if packed else None
    _assert_matches_reference(*_qkv(packed, 16, hq=hq, hkv=2), causal=causal, window=window, cu_seqlens=cu)


def test_nothing_crosses_sequences(path):
    q, k, v = (t.float() for t in _qkv(True, 16))
    out = flash_attention(q, k, v, cu_seqlens=CU)
    alone = flash_attention(q[5:20], k[5:20], v[5:20], cu_seqlens=torch.tensor([0, 15], dtype=torch.int32))
    torch.testing.assert_close(out[5:20], alone)


@MASKS
@TMA
def test_sequences_of_unequal_block_counts_match_fp64_reference(tune, causal, window, tma):
    # 3, 1, 0 and 2 blocks of 32 tokens (5, 2, 0 and 3 of 16; the interpreter's tiles), an empty sequence among them:
    # every program's block range against its own sequence's end (with TMA: each descriptor's bound)
    kernel_path(fa, "triton", tune)
    tune(fa, tma=tma)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(135, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 70, 90, 90, 135], dtype=torch.int32)
    _assert_matches_reference(q, k, v, causal=causal, window=window, cu_seqlens=cu)


def test_tma_only_where_the_inputs_allow_it(tune):
    # a descriptor needs 16-byte aligned rows and contiguous heads (attention._use_tma); other inputs take pointers
    kernel_path(fa, "triton", tune)
    x = torch.zeros(40, 2, 16)
    assert not fa._use_tma(x)  # off unless tuned on
    tune(fa, tma=True)
    assert fa._use_tma(x, x)
    assert not fa._use_tma(x, torch.zeros(x.numel() + 1)[1:].view(x.shape))  # 4 bytes off
    assert not fa._use_tma(x, torch.zeros(40, 2, 32)[:, :, :16])  # heads 32 apart, 16 long


def test_programs_take_the_longest_sequences_first():
    # the kernels' grid walks the sequences in this table's order: longest first, ties in their order, so that the
    # heaviest programs do not start last (on bench_attention.py's packed batch, 0.87 x the time)
    table = fa._sequences([0, 70, 90, 90, 135, 205], torch.device("cpu"))
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 135, 90, 70, 90], [70, 70, 45, 20, 0]]


def test_short_sequence_configs_are_tried_only_for_short_sequences():
    # the configs that fit two programs on a multiprocessor won for short sequences and, picked by the autotuner
    # at 8k and 16k tokens too, made those slower (H200); so the autotuner sees them only up to programs._SHORT tokens
    long, short = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64})], [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32})]
    prune = programs._for_length(long)
    assert prune(long + short, {"seq_bucket": programs._SHORT}) == long + short
    assert prune(long + short, {"seq_bucket": 2 * programs._SHORT}) == long
    for kernel in (programs._fwd_kernel, programs._bwd_dq_kernel, programs._bwd_dkdv_kernel):
        assert kernel.early_config_prune is not None


def test_module_form_and_scale(path):
    q, k, v = (t.float() for t in _qkv(False, 32))
    out = FlashAttention(causal=False, softmax_scale=0.3)(q, k, v)
    ref = flash_attention_ref(q.double(), k.double(), v.double(), causal=False, softmax_scale=0.3)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q": torch.randn(37, 4, 16)}, r"q must be \(B, S, H, D\)"),
        ({"k": torch.randn(2, 37, 3, 16), "v": torch.randn(2, 37, 3, 16)}, "multiple of the key/value heads"),
        ({"v": torch.randn(2, 37, 2, 32)}, "same shape"),
        ({"q": torch.randn(2, 37, 4, 24), "k": torch.randn(2, 37, 2, 24), "v": torch.randn(2, 37, 2, 24)},
         "head dim 24"),
        ({"q": torch.randn(2, 37, 4, 16).double(), "k": torch.randn(2, 37, 2, 16).double(),
          "v": torch.randn(2, 37, 2, 16).double()}, "share one of"),
        ({"window": 4, "causal": False}, "needs causal=True"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(change, match):
    q, k, v = (t.float() for t in _qkv(False, 16))
    kwargs = {"q": q, "k": k, "v": v, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attention(**kwargs)


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (torch.tensor([0, 20, 5, 37], dtype=torch.int32), "never decrease"),
        (torch.tensor([0, 5, 36], dtype=torch.int32), "end at the token count 37"),
        (torch.tensor([0, 5, 37]), "int32"),
    ],
)
def test_bad_cu_seqlens(cu, match):
    q, k, v = (t.float() for t in _qkv(True, 16))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, cu_seqlens=cu)


def test_max_seqlen_shorter_than_a_sequence_is_an_error():
    q, k, v = (t.float() for t in _qkv(True, 16))
    with pytest.raises(ValueError, match=r"max_seqlen=10 is shorter than the longest sequence in cu_seqlens \(17\)"):
        flash_attention(q, k, v, cu_seqlens=CU, max_seqlen=10)


def test_new_offsets_in_old_memory_are_checked():
    q, k, v = (t.float() for t in _qkv(True, 16))
    good = CU.clone()
    flash_attention(q, k, v, cu_seqlens=good)
    # a new tensor over the same memory, at version 0, as a new batch's offsets allocated where the last one's were
    bad = torch.from_numpy(good.numpy())
    bad.numpy()[1:3] = (20, 5)
    with pytest.raises(ValueError, match="never decrease"):
        flash_attention(q, k, v, cu_seqlens=bad)


def test_offsets_are_read_on_the_host_once_per_tensor(monkeypatch, tune):
    # every layer of a step gets the same cu_seqlens; reading them (or their longest sequence) on the host waits
    # for the GPU, so it happens once, not at every call
    from torch.utils._python_dispatch import TorchDispatchMode

    kernel_path(fa, "triton", tune)
    q, k, v = (t.float() for t in _qkv(True, 16))
    cu = CU.clone()
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    flash_attention(q, k, v, cu_seqlens=cu)
    with Ops():
        for _ in range(3):
            flash_attention(q, k, v, cu_seqlens=cu)
    assert torch.ops.aten._local_scalar_dense.default not in ops  # int(tensor), tensor.item()


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@TMA
def test_cuda_error_within_twice_plain_attention_in_the_same_dtype(tune, packed, d, dtype, tma):
    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0 or later")
    tune(fa, tma=tma)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, hq, hkv = 2, 1024, 8, 2
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 100, 700, 1024, 1500, 2048], dtype=torch.int32, device="cuda") if packed else None
    if packed:
        q, k, v = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
    grad = torch.randn_like(q)

    def run(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = fn(*leaves)
        return (out.detach().float(), *(x.float() for x in torch.autograd.grad(out, leaves, grad.to(out.dtype))))

    ref = run(lambda *t: flash_attention_ref(*t, cu_seqlens=cu), q, k, v)
    plain = run(lambda *t: flash_attention_ref(*t, cu_seqlens=cu), *(t.to(dtype) for t in (q, k, v)))
    ours = run(lambda *t: flash_attention(*t, cu_seqlens=cu), *(t.to(dtype) for t in (q, k, v)))
    for name, p, o, r in zip(("out", "dq", "dk", "dv"), plain, ours, ref):
        assert _rel(o, r) <= 2 * _rel(p, r), name
