"""Find what to stream in a model — the block stack, the input embedding, the output head — and install the
logits-free causal-LM loss on Hugging Face models."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import wraps

from torch import Tensor, nn

from .engine.units import replace_forward

log = logging.getLogger(__name__)

# Families whose ForCausalLM.forward is exactly "base model -> lm_head -> ForCausalLMLoss", so computing the loss
# from the hidden states gives the same value. Others keep their own forward (and build full logits).
LOSS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class Layout:
    """The parts of a model the engine treats specially, with their qualified names."""

    blocks: list[tuple[str, nn.Module]]
    embedding: tuple[str, nn.Embedding] | None = None
    head: tuple[str, nn.Linear] | None = None
    # modules outside the blocks whose forward reads their children's parameters directly: each is one unit
    whole: list[tuple[str, nn.Module]] = field(default_factory=list)
    pretrained: nn.Module | None = None  # the outermost Hugging Face model holding the blocks
    causal_lm: nn.Module | None = None  # the Hugging Face *ForCausalLM whose loss we install


def find_layout(root: nn.Module, blocks: str | None = None) -> Layout:
    """Find the stack of transformer blocks (or take the one named), the embedding and the head.

    Args:
        root: the module to search (the LightningModule).
        blocks: attribute path of the block ``nn.ModuleList`` relative to ``root`` (e.g. ``"model.model.layers"``);
            ``None`` picks the ``nn.ModuleList`` of same-type modules that holds the most parameters.

    Raises:
        ValueError: no stack could be found, or the named one is not an ``nn.ModuleList`` of modules.
    """
    names = {m: n for n, m in root.named_modules()}
    stack = _named_stack(root, blocks) if blocks is not None else _largest_stack(root)
    prefix = names[stack]
    layout = Layout(blocks=[(f"{prefix}.{i}", m) for i, m in enumerate(stack)])
    if len(set(map(id, stack))) != len(stack):
        raise ValueError(
            f"The block stack '{prefix}' holds the same module more than once; SlideFormer cannot stream it."
        )
    layout.whole = _reading_children(root, stack)
    hf = _outermost_pretrained(root, stack)
    if hf is None:
        return layout
    layout.pretrained = hf
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    within = {m for _, w in layout.whole for m in w.modules()}
    emb, head = (None if m in within else m for m in (emb, head))
    if type(emb) is nn.Embedding and emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse:
        layout.embedding = (names[emb], emb)
    if type(head) is nn.Linear:
        layout.head = (names[head], head)
        if getattr(hf.config, "model_type", None) in LOSS_FAMILIES and hf.base_model is not hf:
            layout.causal_lm = hf
    return layout


def _named_stack(root: nn.Module, path: str) -> nn.ModuleList:
    try:
        stack = root.get_submodule(path)
    except AttributeError as err:
        raise ValueError(f"blocks={path!r}: no such submodule in {type(root).__name__} ({err}).") from err
    if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
        raise ValueError(
            f"blocks={path!r} must name a non-empty nn.ModuleList of blocks; it is {type(stack).__name__}."
        )
    return stack


def _largest_stack(root: nn.Module) -> nn.ModuleList:
    # the outermost nn.ModuleList that holds the most parameters (not a block's list of experts); its blocks may
    # differ in type (a hybrid model's attention and linear-attention layers)
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    inner = {sub for m in lists for sub in m.modules() if sub is not m}
    best = max((m for m in lists if m not in inner), key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    if best is None or not any(True for _ in best.parameters()):
        raise ValueError(
            f"SlideFormer could not find the stack of transformer blocks in {type(root).__name__}: it looks for an"
            " nn.ModuleList of modules that hold parameters (like model.model.layers in Hugging Face models). Name it"
            " with SlideFormerStrategy(blocks='attribute.path.to.layers')."
        )
    return best


def _reading_children(root: nn.Module, stack: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    # peft's layers (an adapter on the embedding reads its ParameterDict, DoRA on the head reads the base layer's
    # weight) and any module holding a ParameterDict or ParameterList (which has no forward: its parent reads it)
    from peft.tuners.tuners_utils import BaseTunerLayer

    found, covered = [], set(stack.modules())
    for name, module in root.named_modules():
        if module in covered or any(m is stack for m in module.modules()):
            continue
        containers = (nn.ParameterDict, nn.ParameterList)
        if isinstance(module, BaseTunerLayer) or any(isinstance(c, containers) for c in module.children()):
            found.append((name, module))
            covered.update(module.modules())
    return found


def _outermost_pretrained(root: nn.Module, stack: nn.ModuleList) -> nn.Module | None:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    for module in root.modules():
        if isinstance(module, PreTrainedModel) and any(m is stack for m in module.modules()):
            return module
    return None


def disable_hf_checkpointing(root: nn.Module) -> Callable[[], None]:
    """Turn off Hugging Face's own gradient checkpointing while SlideFormer trains: the engine recomputes blocks
    itself. Returns a function that turns it back on where it was on."""
    return _turn_off(
        root, "gradient_checkpointing",
        "Hugging Face gradient checkpointing off while it trains (it recomputes blocks itself); it is on again when"
        " training ends.",
    )  # fmt: skip


def disable_hub_kernels(root: nn.Module) -> Callable[[], None]:
    """Turn off transformers' hub kernels (``use_kernels``, on by default in ``from_pretrained`` where the ``kernels``
    package is installed, as transformers 5.25 installs it): each ``train()`` / ``eval()`` then kernelizes the model
    again, which sets the forwards of its kernel-decorated layers (the RMSNorm) over the engine's patched ones (a
    validation loop's switch made the final norm train outside the engine). Returns a function that turns them back
    on where they were on."""
    return _turn_off(
        root, "use_kernels",
        "transformers' hub kernels (use_kernels) off while it runs: kernelizing at each train/eval switch would"
        " replace the forwards it patches; they are on again when it ends.",
    )  # fmt: skip


def _turn_off(root: nn.Module, flag: str, what: str) -> Callable[[], None]:
    # ``flag`` False on every module of ``root`` where it is True, logged as "SlideFormer turns <what>"; the undo
    switched = [m for m in root.modules() if getattr(m, flag, False) is True]
    for module in switched:
        setattr(module, flag, False)
    if switched:
        log.info("SlideFormer turns %s", what)

    def restore() -> None:
        for module in switched:
            setattr(module, flag, True)

    return restore


def disable_hf_cache(model: nn.Module) -> Callable[[], None]:
    """``config.use_cache`` off while SlideFormer trains, as Hugging Face's Trainer does under gradient checkpointing:
    a block's recompute would add to a KV cache a second time, and a cache passed by position (GPT-2's
    ``layer_past``) gets past the engine's removal of cache keywords. Returns a function that puts it back."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return lambda: None
    config.use_cache = False
    return lambda: setattr(config, "use_cache", True)


def install_causal_lm_loss(model: nn.Module, loss: Callable[..., Tensor]) -> Callable[[], None]:
    """Make ``model(..., labels=...)`` compute its loss with ``loss(hidden, labels, **kw)`` from the hidden states.

    The base model runs as usual; the output head is applied inside ``loss`` (chunked or fused), so the N x vocab
    logits are never built. With labels the returned output has ``logits=None``; without labels the original
    forward runs and returns logits.

    Returns:
        a function that restores the original forward.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    signature = inspect.signature(original)
    extra_name = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    softcap = getattr(model.config, "final_logit_softcapping", None)

    @wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        extra = arguments.pop(extra_name, {}) if extra_name else {}
        labels = arguments.pop("labels", None)
        if labels is None:
            return original(*args, **kwargs)
        arguments.pop("logits_to_keep", None)
        shift_labels = extra.pop("shift_labels", None)
        outputs = model.base_model(**arguments, **extra)
        value = loss(
            outputs.last_hidden_state,
            labels,
            num_items_in_batch=extra.get("num_items_in_batch"),
            shift_labels=shift_labels,
            softcap=softcap,
        )
        return CausalLMOutputWithPast(
            loss=value, logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    return replace_forward(model, forward)
