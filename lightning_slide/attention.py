"""``attn_implementation="slide"``: the project's flash attention kernel behind transformers' attention interface.

Registered on ``import lightning_slide`` with transformers' ``AttentionInterface`` and, for the mask,
``AttentionMaskInterface`` (without a registered mask function the model passes no mask and causality would be
dropped). Like Hugging Face's flash-attention path, the mask is ``None`` or the 2D padding mask; packed batches —
``cu_seq_lens_q``/``max_length_q`` kwargs (``DataCollatorWithFlattening``) or position ids that restart — run the
variable-length kernel, so nothing attends across documents and no (S x S) mask is built.

Dense batches (no padding, no packing, no window) on CUDA run PyTorch's cuDNN attention where it supports the
inputs: on the H200 it is faster than the project's kernel (``benchmarks/bench_attention.py``), and a user
fine-tuning one dense batch after another gets the fastest kernel there is. Everything else — and everything when
cuDNN cannot run the inputs — takes the project's kernel. ``attn_implementation="slide_kernel"`` sends dense batches
to the kernel too. Inside a streamed block that keeps its attention outputs (``engine/kept_attention.py``) each call
runs through it: cuDNN's forward and backward ops directly, the kernel's as ``FlashKernel``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from .engine.kept_attention import through
from .kernels.attention import HEAD_DIMS, flash_attention

NAME = "slide"  # dense CUDA batches to PyTorch's cuDNN attention where it runs them (module docstring)
KERNEL_ONLY = "slide_kernel"  # every batch to the project's kernel
log = logging.getLogger(__name__)
# what position ids and padding masks say, read on the host, for the most recent few (see _host_read)
_HOST_READS: OrderedDict[tuple, tuple[Tensor, object]] = OrderedDict()


def use_slide_attention(model: nn.Module, required: bool, name: str = NAME) -> Callable[[], None] | None:
    """Switch a Hugging Face model to ``attn_implementation=name`` (``"slide"`` or ``"slide_kernel"``) if the kernel
    covers its attention.

    Args:
        model: a transformers ``PreTrainedModel``.
        required: raise if it cannot be switched (else log why and keep the model's own attention).
        name: the implementation.

    Returns:
        a function that restores the previous implementation, or ``None`` if nothing changed.
    """
    config = model.config
    previous = config._attn_implementation
    head_dim = _head_dim(config)
    why = None
    if head_dim not in HEAD_DIMS:
        why = f"head dim {head_dim} (supported: {HEAD_DIMS})"
    elif getattr(config, "attention_dropout", 0.0):
        why = f"attention_dropout={config.attention_dropout} (the kernel has no attention dropout)"
    elif getattr(config, "attn_logit_softcapping", None):
        why = "attention logit soft-capping"
    if why is not None:
        if required:
            raise ValueError(f"attention={name!r} cannot run this model: {why}. Use attention='auto' or None.")
        log.info("SlideFormer keeps attn_implementation=%r: %s.", previous, why)
        return None
    if previous == name:
        return None
    model.set_attn_implementation(name)
    return lambda: model.set_attn_implementation(previous)


def kept_bytes_per_token(model: nn.Module | None, itemsize: int) -> int:
    """Device bytes per token and block of what a streamed block keeps of its attention calls
    (``engine/kept_attention.py``): the output in the compute dtype (``itemsize`` bytes) and an fp32 statistic per
    query head; 0 where the model's attention is not this module's."""
    config = getattr(model, "config", None)
    if config is None or config._attn_implementation not in (NAME, KERNEL_ONLY):
        return 0
    return config.num_attention_heads * (_head_dim(config) * itemsize + 4)


def slide_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    cudnn: bool = True,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, S, D), key/value (B, Hkv, S, D); returns the output
    as (B, S, Hq, D) and no attention weights. ``cudnn``: dense CUDA batches may take PyTorch's cuDNN attention."""
    if dropout and module.training:
        raise ValueError(f"attn_implementation='slide' has no attention dropout; got dropout={dropout}.")
    if softcap is not None:
        raise ValueError("attn_implementation='slide' does not implement attention logit soft-capping.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    options = dict(causal=causal, softmax_scale=scaling, window=sliding_window, through=through())
    batch, length = q.shape[:2]
    if kwargs.get("cu_seq_lens_q") is not None:
        cu = kwargs["cu_seq_lens_q"].to(torch.int32)
        out = flash_attention(*_flat(q, k, v), cu_seqlens=cu, max_seqlen=int(kwargs["max_length_q"]), **options)
        return out.view(batch, length, *out.shape[1:]), None
    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, options), None
    cu = _restarts(kwargs.get("position_ids"), batch)
    if cu is not None:
        out = flash_attention(*_flat(q, k, v), cu_seqlens=cu, **options)
        return out.view(batch, length, *out.shape[1:]), None
    heads_first = [t.transpose(1, 2) for t in (q, k, v)]  # (B, H, S, D), in the compute dtype
    gqa = q.shape[2] != k.shape[2]
    if cudnn and sliding_window is None and _cudnn_runs(*heads_first, causal, gqa):
        if options["through"] is not None:  # a streamed block keeping its outputs (engine/kept_attention.py)
            return options["through"](_Cudnn(causal, scaling), *heads_first).transpose(1, 2), None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                *heads_first, is_causal=causal, scale=scaling, enable_gqa=gqa
            )
        return out.transpose(1, 2), None
    return flash_attention(q, k, v, **options), None


def slide_kernel_attention_forward(*args, **kwargs) -> tuple[Tensor, None]:
    """``attn_implementation="slide_kernel"``: :func:`slide_attention_forward` with every batch on the kernel."""
    return slide_attention_forward(*args, cudnn=False, **kwargs)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _cudnn_runs(query: Tensor, key: Tensor, value: Tensor, causal: bool, gqa: bool) -> bool:
    """Whether PyTorch's cuDNN attention takes these dense (B, H, S, D) inputs (dtype, head dim, GPU, versions)."""
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    return can_use_cudnn_attention(SDPAParams(query, key, value, None, 0.0, causal, gqa), False)


@dataclass(frozen=True)
class _Cudnn:
    """PyTorch's cuDNN attention on dense (B, H, S, D) inputs (GQA too), its forward and backward ops called as SDPA's
    autograd calls them, for a caller that keeps the output and its statistics (``kernels.attention.FlashKernel``'s
    two methods)."""

    causal: bool
    scale: float | None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, self.causal, False, scale=self.scale
        )
        return out, (lse, cum_q, cum_k, seed, offset)

    def backward(self, q, k, v, out, stats: tuple[Tensor, ...], dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lse, cum_q, cum_k, seed, offset = stats
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, self.causal,
            scale=self.scale,
        )  # fmt: skip


def _flat(*tensors: Tensor) -> list[Tensor]:
    return [t.reshape(-1, *t.shape[2:]) for t in tensors]


def _padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, options: dict) -> Tensor:
    # mask: (B, S) bool, True for real tokens (each row's tokens contiguous, left or right padded)
    batch, length = q.shape[:2]
    keep, cu, longest = _host_read(mask, "unpad", lambda: _unpadding(mask))
    q_, k_, v_ = (t[keep] for t in _flat(q, k, v))
    out = flash_attention(q_, k_, v_, cu_seqlens=cu, max_seqlen=longest, **options)
    full = out.new_zeros(batch * length, *out.shape[1:])
    full[keep] = out
    return full.view(batch, length, *out.shape[1:])


def _unpadding(mask: Tensor) -> tuple[Tensor, Tensor, int]:
    # the real tokens' positions in the flat (B*S) batch, their cu_seqlens, and the longest row
    lengths = mask.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return mask.reshape(-1).nonzero().squeeze(1), cu, int(lengths.max())


def _restarts(position_ids: Tensor | None, batch: int) -> Tensor | None:
    """cu_seqlens of the packed documents in (B, S) position ids; None when no row has more than one."""
    if position_ids is None or position_ids.shape[-1] == 1:
        return None
    return _host_read(position_ids, ("restarts", batch), lambda: _find_restarts(position_ids, batch))


def _host_read(t: Tensor, what: object, compute: Callable[[], object]):
    """``compute()``, which reads ``t`` on the host, kept for the few most recent tensors.

    Reading on the host synchronizes with the GPU (it idled before every block: ``benchmarks/NOTES.md``). Every layer,
    and its recompute, gets the same tensor: the answer is keyed by its memory and version counter (shared by the
    detached copies the recompute sees); the entry holds the tensor, so that memory is not reused while it is kept.
    """
    key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t._version, what)
    if key not in _HOST_READS:
        _HOST_READS[key] = (t, compute())
        while len(_HOST_READS) > 8:
            _HOST_READS.popitem(last=False)
    return _HOST_READS[key][1]


def _find_restarts(position_ids: Tensor, batch: int) -> Tensor | None:
    # As Hugging Face's ``find_packed_sequence_indices``: a document starts at every row start and wherever the
    # position does not follow the previous one (a row may open with the tail of a document, at position > 0).
    ids = position_ids.expand(batch, -1)
    breaks = ids.diff(dim=1) != 1
    if not breaks.any():
        return None
    starts = torch.cat([torch.ones_like(breaks[:, :1]), breaks], dim=1).reshape(-1).nonzero().squeeze(1)
    return torch.cat([starts, starts.new_tensor([ids.numel()])]).to(torch.int32)


def register() -> None:
    """Make ``attn_implementation="slide"`` available to transformers models (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, slide_attention_forward)
    AttentionInterface.register(KERNEL_ONLY, slide_kernel_attention_forward)
    for name in (NAME, KERNEL_ONLY):
        AttentionMaskInterface.register(name, flash_attention_mask)
