"""Every causal-LM family the installed transformers ships, built from a tiny config and trained four micro-batches
(fp32, clipping, accumulation) with plain Lightning and with SlideFormer: the same training, or refused by the
boundary guard before any weight changes. Families that cannot be built small, or that plain Lightning cannot train,
are skipped with the reason. Slow (about two minutes on two cores): ``pytest -m slow``."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import VOCAB, fit, relative_update, token_data
from lightning_slide import BoundaryError, SlideFormerStrategy
from lightning_slide.fused import use_fused_ops
from lightning_slide.kernels import norm as norm_kernel

pytestmark = pytest.mark.slow

TOL = 1e-3  # relative update difference from plain Lightning, beside any rounding a second plain run shows
MAX_PARAMS = 5_000_000
# the config fields of a tiny model; each family takes those its config has
TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
    d_model=32, d_ff=64, d_kv=8, num_layers=3, num_heads=4, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
    n_input_layers=1, n_output_layers=1,  # looped models (Dory): each layer once per loop, as in their own configs
    mamba_chunk_size=16, mamba_d_state=16,  # Mamba2 mixers (Falcon-H1): their reference scan pads to a whole chunk
    chunk_size=16, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, moe_shared_expert_intermediate_size=32,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,  # Inkling's sliding-window layers
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
)  # fmt: skip
SEQ2SEQ = ("t5", "bart")


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + [f"{name}-seq2seq" for name in SEQ2SEQ]


def _config(family: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family.removesuffix("-seq2seq")]
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    config = cls(**{k: v for k, v in TINY.items() if k in known})
    if family.endswith("-seq2seq"):
        config.decoder_start_token_id = 0
    return config


class ZooLM(L.LightningModule):
    """The module a user writes, for a causal LM or (``seq2seq``) an encoder-decoder."""

    def __init__(self, config, seq2seq: bool):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        self.model = auto.from_config(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def _build(family: str) -> ZooLM:
    try:
        config = _config(family)
        with torch.device("meta"):
            size = sum(p.numel() for p in ZooLM(config, family.endswith("-seq2seq")).parameters())
        if size > MAX_PARAMS:
            pytest.skip(f"{family}: {size / 1e6:.0f}M parameters at its tiny config (above {MAX_PARAMS / 1e6:.0f}M)")
        torch.manual_seed(0)
        return ZooLM(config, family.endswith("-seq2seq"))
    except Exception as err:  # the reason is the skip's message
        pytest.skip(f"{family}: cannot be built from a tiny config: {type(err).__name__}: {str(err)[:200]}")


@pytest.mark.parametrize("family", _families())
def test_family_trains_as_plain_lightning_or_is_refused(family):
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    module = _build(family)
    start = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    kwargs = dict(steps=2, gradient_clip_val=0.5, accumulate_grad_batches=2)
    try:
        ref, _ = fit(module, "auto", **kwargs)
    except Exception as err:
        pytest.skip(f"{family}: plain Lightning cannot train it: {type(err).__name__}: {str(err)[:200]}")
    try:
        ours, _ = fit(module, SlideFormerStrategy(num_slots=2), **kwargs)
    except BoundaryError:
        _assert_refused_before_any_update(module, start)
        return
    err, rounding = relative_update(ours, ref, start), 0.0
    if err > TOL:  # beside the rounding a second plain run shows
        rounding = relative_update(fit(module, "auto", **kwargs)[0], ref, start)
    assert err <= TOL + rounding, f"{family}: relative update difference {err:.2e} (plain vs plain: {rounding:.2e})"


def _assert_refused_before_any_update(module: ZooLM, start: dict) -> None:
    trainer = L.Trainer(strategy=SlideFormerStrategy(num_slots=2), accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.raises(BoundaryError):
        trainer.fit(module, DataLoader(TensorDataset(token_data()), batch_size=4))
    for k, v in module.state_dict().items():
        assert torch.equal(v.float(), start[k]), f"{k} changed before the refusal"


def test_tiny_configs_really_build_most_families():
    # the sweep above means something only if most families build: a TINY typo would skip them all
    from transformers import AutoModelForCausalLM

    built = 0
    for family in ("llama", "gpt2", "mixtral", "gemma2", "phi3", "falcon", "gpt_neox", "mamba"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config(family))
        built += sum(p.numel() for p in model.parameters()) < MAX_PARAMS and isinstance(model, nn.Module)
    assert built == 8


@pytest.mark.parametrize("family", _families())
def test_fused_ops_leave_every_family_computing_the_same(family):
    # the fused kernels (RMSNorm, rotary, SwiGLU) take over only code that computes Llama's formulas (fused.py)
    if not norm_kernel._INTERPRET:
        pytest.skip("the kernels on CPU tensors need TRITON_INTERPRET=1")
    module = _build(family)
    ids = token_data(n=2)

    def loss_and_grads():
        module.zero_grad()
        torch.manual_seed(0)  # the same dropout masks
        loss = module.training_step((ids,), 0)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    try:
        want = loss_and_grads()
    except Exception as err:
        pytest.skip(f"{family}: plain forward/backward fails: {type(err).__name__}: {str(err)[:200]}")
    restore = use_fused_ops(module)
    if restore is None:
        return  # nothing switched: the model runs its own code
    try:
        got = loss_and_grads()
    finally:
        restore()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    exact = None
    for name, grad in want[1].items():
        err = ((got[1][name] - grad).norm() / grad.norm().clamp_min(1e-6)).item()
        if err >= 1e-4:  # a tiny gradient fp32 rounds coarsely (Doge's A: 2e-4 plain vs float64): twice plain's error
            exact = exact or _float64_grads(module, loss_and_grads)
            excess = (got[1][name] - exact[name]).norm() - 2 * (grad - exact[name]).norm()
            err = (excess / exact[name].norm().clamp_min(1e-6)).item()
        assert err < 1e-4, f"{name}: {err:.2e}"


def _float64_grads(module: ZooLM, loss_and_grads) -> dict:
    # a mixture of experts runs its experts one by one: torch's grouped matrix product takes no float64
    experts = getattr(module.model.config, "_experts_implementation", None)
    if experts not in (None, "eager"):
        module.model.set_experts_implementation("eager")
    module.double()
    try:
        return {name: grad.float() for name, grad in loss_and_grads()[1].items()}
    finally:
        module.float()
        if experts not in (None, "eager"):
            module.model.set_experts_implementation(experts)
