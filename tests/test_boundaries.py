"""What crosses a streamed module's boundary other than its arguments and outputs (engine/guard.py): carried through
its node (transformers' MoE router logits, a user's hook on a submodule, peft adapters on the embedding and the head)
or refused before any weight changes (shared K/V, an attribute read by the loss, a weight read outside its module)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import VOCAB, CausalLM, StackLM, fit, max_rel_error, tiny_config, token_data
from lightning_slide import BoundaryError, SlideFormerStrategy

TOL = 1e-5
KWARGS = dict(steps=4, gradient_clip_val=0.5, accumulate_grad_batches=2)


def _moe_config(family: str, aux: bool):
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, num_experts_per_tok=2,
                  output_router_logits=aux, router_aux_loss_coef=0.5)  # fmt: skip
    if family == "mixtral":
        return MixtralConfig(num_local_experts=4, **common)
    return Qwen2MoeConfig(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32, **common)


@pytest.mark.parametrize("schedule", ["forward", "backward"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_router_aux_loss_trains_as_plain_lightning(family, schedule):
    # transformers collects the router logits with forward hooks inside the blocks; their aux loss must reach the
    # routers exactly as in plain training (it was dropped: 0.19-0.21 from plain Lightning at coefficient 0.5)
    kwargs = KWARGS if schedule == "forward" else dict(steps=4)  # clipping and accumulation, or neither
    module = CausalLM(_moe_config(family, aux=True))
    ref, _ = fit(module, "auto", **kwargs)
    without, _ = fit(CausalLM(_moe_config(family, aux=False)), "auto", **kwargs)
    assert max_rel_error(without, ref)[0] > 100 * TOL  # the aux loss changes this training
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2, update_schedule=schedule), **kwargs)
    err, where = max_rel_error(ours, ref)
    assert err < TOL, f"{where}: {err:.2e}"


class _HookedLM(StackLM):
    """A user's forward hook keeps what one submodule of each block returns, for a penalty added to the loss."""

    def __init__(self):
        super().__init__(dropout=0.0)
        for block in self.net.blocks:
            block[1].register_forward_hook(lambda m, a, out: setattr(m, "kept", out))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        kept = [block[1].__dict__.pop("kept") for block in self.net.blocks]
        return loss + 0.1 * sum(out.pow(2).mean() for out in kept)


def test_a_submodule_output_a_hook_captures_is_carried():
    module = _HookedLM()
    ref, _ = fit(module, "auto", **KWARGS)
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2), **KWARGS)
    err, where = max_rel_error(ours, ref)
    assert err < TOL, f"{where}: {err:.2e}"


@pytest.mark.parametrize("case", ["lora", "dora", "trainable_tokens", "rslora", "ia3", "modules_to_save"])
def test_peft_methods_train_as_plain_lightning(case):
    # peft's layers on the embedding and the head read their adapter weights (and DoRA the base weight) directly:
    # each such layer is one unit
    from peft import IA3Config, LoraConfig, get_peft_model

    config = {
        "lora": LoraConfig(r=4, target_modules=["embed_tokens", "q_proj", "lm_head"]),
        "dora": LoraConfig(r=4, target_modules=["embed_tokens", "v_proj", "lm_head"], use_dora=True),
        "trainable_tokens": LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 5, 7]),
        "rslora": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
        "ia3": IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "modules_to_save": LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    }[case]
    module = CausalLM(tiny_config("llama"))
    module.model = get_peft_model(module.model, config)
    for name, p in module.model.named_parameters():  # peft starts B at zero: A would not move in the first step
        if "lora_B" in name or "lora_embedding_B" in name:
            nn.init.normal_(p, std=0.02)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    ref, _ = fit(module, "auto", **KWARGS)
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2), **KWARGS)
    err, where = max_rel_error(ours, ref)
    assert err < TOL, f"{where}: {err:.2e}"
    moved = [k for k in ref if not torch.equal(ref[k], start[k])]
    assert moved
    assert all(not torch.equal(ours[k], start[k]) for k in moved)


@pytest.mark.parametrize("target", ["router", "experts"])
def test_peft_lora_on_bare_parameters_trains_as_plain_lightning(target):
    # peft's ParamWrapper (LoRA on an nn.Parameter: Mixtral's router weight, its fused experts) adds a parametrization
    # in each forward: its set_ on one weight must not mark the block's other weights, views of one slot, as modified
    from peft import LoraConfig, get_peft_model

    targets = {"router": dict(target_modules=["q_proj", "gate"]),
               "experts": dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])}  # fmt: skip
    module = CausalLM(_moe_config("mixtral", aux=True))
    module.model = get_peft_model(module.model, LoraConfig(r=4, **targets[target]))
    for name, p in module.model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    ref, _ = fit(module, "auto", **KWARGS)
    ours, trained = fit(module, SlideFormerStrategy(num_slots=2), **KWARGS)
    err, where = max_rel_error(ours, ref)
    assert err < TOL, f"{where}: {err:.2e}"
    for m in trained.modules():  # no device copy left behind as a buffer beside its parameter
        assert not set(m._buffers) & set(m._parameters)


def _refused(module: L.LightningModule, match: str, precision: str = "32-true") -> None:
    # refused before any weight changes, and the model left as given (its own forwards back)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    forwards = {name: m.__dict__.get("forward") for name, m in module.named_modules()}
    trainer = L.Trainer(strategy=SlideFormerStrategy(num_slots=2), accelerator="cpu", devices=1, max_steps=2,
                        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.raises(BoundaryError, match=match):
        trainer.fit(module, DataLoader(TensorDataset(token_data()), batch_size=4))
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed before the refusal"
    assert {name: m.__dict__.get("forward") for name, m in module.named_modules()} == forwards


def test_layers_sharing_keys_and_values_are_refused_before_any_update():
    from transformers import Gemma3nTextConfig

    config = Gemma3nTextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2, max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
    )  # fmt: skip
    _refused(CausalLM(config), r"'model.model.layers.2' uses a tensor computed inside 'model.model.layers.0'")


class _StashLM(StackLM):
    """Each block keeps an intermediate result in an attribute; the loss reads it."""

    def __init__(self):
        super().__init__(dropout=0.0)
        for block in self.net.blocks:
            block.forward = lambda x, block=block: self._stash(block, x)

    @staticmethod
    def _stash(block: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        hidden = block[1](block[0](x))
        block.penalty = hidden.pow(2).mean()
        return block[4](block[3](block[2](hidden)))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + sum(b.penalty for b in self.net.blocks)


def test_a_tensor_kept_in_an_attribute_and_read_by_the_loss_is_refused():
    _refused(_StashLM(), r"The loss depends on a tensor computed inside 'net.blocks.\d' .*an attribute")


class _ReadsEmbeddingLM(StackLM):
    """The output layer reads the embedding's weight directly (tying by hand)."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        net = self.net
        x = net.embed(ids)
        for block in net.blocks:
            x = x + block(x)
        logits = net.norm(x) @ net.embed.weight.T
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_a_weight_read_outside_its_module_is_refused_by_name_before_any_update():
    _refused(_ReadsEmbeddingLM(), r"Parameter 'net.embed.weight' is read in the forward outside the forward of the")
