"""The host-memory plan: computed before anything is pinned, checked against the machine, and true to reality."""

import lightning as L
import pytest
import torch
from torch import nn

from helpers import CausalLM, fit, tiny_config
from lightning_slide import SlideFormerStrategy
from lightning_slide.engine import EngineConfig
from lightning_slide.engine.planner import HostPlan, check_host, plain_training_bytes


@pytest.mark.parametrize(
    ("clip", "accumulate", "precision"),
    [(None, 1, "32-true"), (0.5, 1, "32-true"), (None, 2, "32-true"), (0.5, 1, "bf16-mixed")],
)
def test_plan_matches_what_training_allocates(clip, accumulate, precision):
    seen = {}

    class Measure(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            engine = trainer.strategy.engine
            seen["plan"] = engine.host_plan()
            state = trainer.optimizers[0].state.values()
            seen["state"] = sum(t.numel() * t.element_size() for s in state for t in s.values() if t.dim() > 0)
            seen["retained"] = sum(t.numel() * t.element_size() for t in engine.updates.host.values())
            seen["masters"] = sum(p.numel() * p.element_size() for p in module.parameters())

    module = CausalLM(tiny_config("llama"))
    compact = EngineConfig(compact_retained_grads=True)  # bf16-mixed, clipped: bf16 gradients
    fit(module, SlideFormerStrategy(num_slots=2, engine=compact), steps=2, gradient_clip_val=clip,
        accumulate_grad_batches=accumulate, precision=precision, callbacks=[Measure()])  # fmt: skip
    plan = seen["plan"]
    assert plan.masters == pytest.approx(seen["masters"], rel=0.1)
    assert plan.optimizer_state == pytest.approx(seen["state"], rel=0.1)
    # the plan counts the embedding's whole fp32 gradient, where the "forward" schedule keeps only its touched rows
    embedding = module.model.get_input_embeddings().weight.numel() * 4
    assert seen["retained"] <= plan.retained_grads <= seen["retained"] + embedding
    assert (plan.retained_grads > 0) == (clip is not None or accumulate > 1)


def test_too_little_ram_is_refused_before_anything_moves(monkeypatch):
    import lightning_slide.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: 1 << 16)  # 64 KiB free
    from torch.utils.data import DataLoader, TensorDataset

    from helpers import token_data

    module = CausalLM(tiny_config("llama"))
    before = {k: (v.data_ptr(), v.dtype) for k, v in module.state_dict().items()}
    trainer = L.Trainer(strategy=SlideFormerStrategy(num_slots=2), accelerator="cpu", max_steps=1, logger=False,
                        enable_checkpointing=False)  # fmt: skip
    with pytest.raises(MemoryError, match=r"more host memory but only 0\.00 GiB is available.*optimizer state"):
        trainer.fit(module, DataLoader(TensorDataset(token_data()), batch_size=4))
    assert {k: (v.data_ptr(), v.dtype) for k, v in module.state_dict().items()} == before


def test_ram_already_over_the_budget_is_said_so():
    # slide plan for 70 B on 128 GiB: the model as loaded is more than the RAM the run may take
    GIB = 2**30
    plan = HostPlan(masters=4 * GIB, optimizer_state=8 * GIB, retained_grads=0, landing=0, largest_unit=0,
                    pinned=0, disk=0, activations=0)  # fmt: skip
    with pytest.raises(MemoryError, match=r"needs 8\.00 GiB more host memory but the memory in use is 3\.00 GiB over"):
        check_host(plan, available=-3 * GIB, memlock=None)


def test_locked_memory_limit_is_named():
    plan = HostPlan(masters=8 << 30, optimizer_state=16 << 30, retained_grads=0, landing=2 << 30,
                    largest_unit=1 << 30, pinned=10 << 30)  # fmt: skip
    with pytest.raises(MemoryError, match=r"ulimit -l"):
        check_host(plan, available=64 << 30, memlock=64 << 20)
    check_host(plan, available=64 << 30, memlock=None)  # unlimited: fine


def test_frozen_bf16_storage_is_planned():
    from peft import LoraConfig, get_peft_model

    seen = {}

    class Measure(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen["plan"] = trainer.strategy.engine.host_plan()
            seen["masters"] = sum(p.numel() * p.element_size() for p in module.parameters())

    module = CausalLM(tiny_config("llama"))
    module.model = get_peft_model(module.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    fit(module, SlideFormerStrategy(num_slots=2), precision="bf16-mixed", steps=1, callbacks=[Measure()])
    assert seen["plan"].masters == seen["masters"]
    assert seen["plan"].optimizer_state == 8 * sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_bf16_state_halves_the_planned_state_in_ram_and_on_disk():
    import torch

    from lightning_slide.engine.planner import plan_host

    params = [torch.nn.Parameter(torch.zeros(1024, 512)), torch.nn.Parameter(torch.zeros(512))]
    optimizer = torch.optim.AdamW(params)
    plans = {
        size: plan_host([params], optimizer, landing_bytes=0, pinned=False, state_itemsize=size) for size in (4, 2)
    }
    numel = sum(p.numel() for p in params)
    assert plans[4].optimizer_state == 2 * 4 * numel
    assert plans[2].optimizer_state == 2 * 2 * numel
    on_disk = {size: plan_host([params], optimizer, landing_bytes=0, pinned=False, state_itemsize=size,
                               state_block_numel=1 << 16).disk for size in (4, 2)}  # fmt: skip
    for size in (4, 2):  # two moments of each tensor, each in whole 4 KiB pages
        assert on_disk[size] == 2 * (1024 * 512 * size + 4096)


def test_units_kept_on_the_device_count_bf16_moments_and_no_temporaries_where_the_engine_steps_them():
    layer = nn.Linear(8, 4)  # 36 fp32 parameters
    optimizer = torch.optim.AdamW(layer.parameters())
    fp32 = plain_training_bytes(list(layer.parameters()), optimizer, copies_itemsize=2)
    bf16 = plain_training_bytes(list(layer.parameters()), optimizer, copies_itemsize=2, bf16_state=True)
    assert (fp32.held, fp32.copies, fp32.temporaries) == (36 * (4 + 4 + 8), 32 * 2, 36 * 4)  # torch's foreach AdamW
    assert (bf16.held, bf16.copies, bf16.temporaries) == (36 * (4 + 4 + 4), 32 * 2, 0)  # the Triton update in place
