"""attn_implementation="slide" in real transformers models matches SDPA: dense, packed, padded."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import lightning_slide  # noqa: F401  (registers "slide")
from helpers import VOCAB, tiny_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _pair(family, device="cpu", head_dim=16, name="slide"):
    def config():  # one each: from_config records the attention implementation on the config object
        return tiny_config(family, hidden_size=64, intermediate_size=128, head_dim=head_dim)  # the kernel's head dims

    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa")
    slide = AutoModelForCausalLM.from_config(config(), attn_implementation=name)
    slide.load_state_dict(sdpa.state_dict())
    assert (sdpa.config._attn_implementation, slide.config._attn_implementation) == ("sdpa", name)
    return sdpa.to(device), slide.to(device)


def _loss_and_grads(model, **inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(sdpa, slide, **inputs):
    """CPU (fp32): slide equals SDPA. CUDA (bf16, the kernel's dtype there): slide's error against fp32 SDPA is at
    most twice bf16 SDPA's."""
    if inputs["input_ids"].device.type == "cpu":
        _assert_same(_loss_and_grads(slide, **inputs), _loss_and_grads(sdpa, **inputs))
        return
    ref = _loss_and_grads(sdpa, **inputs)
    plain = _loss_and_grads(copy.deepcopy(sdpa).bfloat16(), **inputs)
    ours = _loss_and_grads(slide.bfloat16(), **inputs)

    def error(run):
        loss, grads = run
        diff = sum((grads[n].float() - ref[1][n]).norm() ** 2 for n in grads)
        return (loss.float() - ref[0]).abs().item(), (diff / sum(g.norm() ** 2 for g in ref[1].values())).sqrt()

    (loss_ours, grads_ours), (loss_plain, grads_plain) = error(ours), error(plain)
    assert loss_ours <= 2 * loss_plain + 1e-3
    assert grads_ours <= 2 * grads_plain


def _assert_same(a, b, tol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=tol, atol=tol)
    for name in grads_a:
        err = ((grads_a[name] - grads_b[name]).norm() / grads_b[name].norm().clamp_min(1e-12)).item()
        assert err < tol, f"{name}: {err:.2e}"


ROUTES = [("cpu", False), *(pytest.param("cuda", cudnn, marks=pytest.mark.gpu) for cudnn in (False, True))]


@pytest.mark.parametrize(("device", "cudnn"), ROUTES)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_dense_matches_sdpa(family, device, cudnn, monkeypatch):
    # on CUDA both routes of a dense batch: "slide_kernel" the project's kernel, "slide" PyTorch's cuDNN attention
    # (attention.py); Mistral's sliding window always takes the kernel
    from lightning_slide import attention

    kernel_calls = []
    kernel = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    sdpa, slide = _pair(family, device, head_dim=64 if cudnn else 16, name="slide" if cudnn else "slide_kernel")
    ids = torch.randint(0, VOCAB, (2, 23), device=device)
    _check(sdpa, slide, input_ids=ids, labels=ids)
    assert bool(kernel_calls) != (cudnn and family != "mistral")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows",
    [[range(7), range(15), range(8)],
     # several rows, each opening with the tail of a document (its positions continue from an earlier row)
     [range(5, 9), range(15), range(11), range(28, 31), range(27), range(11, 14), range(27)]],
)  # fmt: skip
def test_packed_documents_via_position_ids_match_sdpa(device, rows):
    sdpa, slide = _pair("llama", device)
    position_ids = torch.tensor([p for r in rows for p in r]).view(-1, 30).to(device)
    ids = torch.randint(0, VOCAB, position_ids.shape, device=device)
    # use_cache=False: with a cache, Hugging Face's SDPA path does not detect packing (masking_utils)
    _check(sdpa, slide, input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False)


def test_flattening_collator_kwargs_match_position_ids():
    _, slide = _pair("llama")
    ids = torch.randint(0, VOCAB, (1, 30))
    position_ids = torch.cat([torch.arange(n) for n in (7, 15, 8)]).unsqueeze(0)
    cu = torch.tensor([0, 7, 22, 30], dtype=torch.int32)
    by_kwargs = _loss_and_grads(
        slide, input_ids=ids, labels=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=15, max_length_k=15,
    )  # fmt: skip
    _assert_same(by_kwargs, _loss_and_grads(slide, input_ids=ids, labels=ids, position_ids=position_ids))


def test_right_padding_matches_sdpa():
    sdpa, slide = _pair("qwen3")
    ids = torch.randint(0, VOCAB, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    _assert_same(_loss_and_grads(slide, **inputs), _loss_and_grads(sdpa, **inputs))


def test_documents_are_found_once_for_all_layers(monkeypatch):
    # finding the documents reads the position ids on the host (a GPU synchronization): once per batch, not per layer
    from lightning_slide import attention

    _, slide = _pair("llama")
    calls = []
    find = attention._find_restarts
    monkeypatch.setattr(attention, "_find_restarts", lambda *args: calls.append(1) or find(*args))
    position_ids = torch.cat([torch.arange(n) for n in (7, 15, 8)]).unsqueeze(0)
    ids = torch.randint(0, VOCAB, (1, 30))
    _loss_and_grads(slide, input_ids=ids, labels=ids, position_ids=position_ids)
    assert len(calls) == 1
    position_ids[0, 7:22] += 7  # changed in place: one document fewer, found again
    changed = _loss_and_grads(slide, input_ids=ids, labels=ids, position_ids=position_ids)
    assert len(calls) == 2
    _assert_same(changed, _loss_and_grads(slide, input_ids=ids, labels=ids, position_ids=position_ids.clone()))


def test_padding_is_read_once_for_all_layers(monkeypatch):
    # the real tokens' positions and lengths are read on the host (a GPU synchronization): once per batch, not per
    # layer (and the kernels then get one cu_seqlens tensor, whose offsets they check once)
    from lightning_slide import attention

    _, slide = _pair("qwen3")
    assert slide.config.num_hidden_layers > 1
    calls = []
    unpadding = attention._unpadding
    monkeypatch.setattr(attention, "_unpadding", lambda *args: calls.append(1) or unpadding(*args))
    ids = torch.randint(0, VOCAB, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    _loss_and_grads(slide, input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert len(calls) == 1
