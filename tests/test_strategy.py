"""The strategy as Lightning sees it: registration, construction, precision, devices, and bad input."""

import importlib

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_slide
from helpers import CausalLM, StackLM, fit, global_error, max_rel_error, streamed, tiny_config, token_data
from lightning_slide import SlideFormerPrecision, SlideFormerStrategy
from lightning_slide.engine import EngineConfig


def _loader():
    return DataLoader(TensorDataset(token_data()), batch_size=4)


def _trainer(**kwargs):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


def test_registered_on_import_and_reimport_is_harmless():
    assert "slideformer" in StrategyRegistry
    importlib.reload(lightning_slide)
    assert "slideformer" in StrategyRegistry


def test_string_keeps_our_precision_and_root_device():
    trainer = _trainer(strategy="slideformer", precision="bf16-mixed")
    assert isinstance(trainer.strategy, SlideFormerStrategy)
    assert isinstance(trainer.strategy.precision_plugin, SlideFormerPrecision)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    assert trainer.strategy.root_device == torch.device("cpu")
    assert _trainer(strategy="slideformer").strategy.precision_plugin.precision == "32-true"  # CPU default


def test_instance_with_options():
    strategy = SlideFormerStrategy(num_slots=4, update_schedule="forward")
    trainer = _trainer(strategy=strategy, precision="32-true")
    assert trainer.strategy is strategy
    assert strategy.num_slots == 4
    assert trainer.strategy.precision_plugin.precision == "32-true"


@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "64-true"])
def test_unsupported_precision_is_a_clear_error(precision):
    with pytest.raises(ValueError, match="bf16-mixed' or '32-true'"):
        _trainer(strategy="slideformer", precision=precision)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 1}, "num_slots must be an int >= 2 or 'auto'"),
        ({"update_schedule": "sideways"}, "update_schedule must be"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite must be"),
        ({"cpu_threads": 0}, "cpu_threads must be"),
        ({"attention": "flash"}, "attention must be 'auto', 'slide', 'slide_kernel' or None"),
        ({"offload_activations": "sometimes"}, "offload_activations must be True, False or 'auto'"),
        ({"engine": {"landing_buffers": 8}}, "engine must be a lightning_slide.engine.EngineConfig"),
        ({"timeout": 60}, "timeout must be a positive datetime.timedelta; got 60"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SlideFormerStrategy(**kwargs)


def test_lightning_cli_yaml_class_path(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  max_steps: 1\n"
        "  strategy:\n"
        "    class_path: lightning_slide.SlideFormerStrategy\n"
        "    init_args:\n"
        "      num_slots: 2\n"
        "      engine:\n"
        "        landing_buffers: 8\n"
        "        split_embedding_update: false\n"
    )
    cli = LightningCLI(StackLM, run=False, args=["--config", str(config)], save_config_kwargs={"overwrite": True})
    assert isinstance(cli.trainer.strategy, SlideFormerStrategy)
    assert cli.trainer.strategy.num_slots == 2
    assert cli.trainer.strategy.engine_config == EngineConfig(landing_buffers=8, split_embedding_update=False)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("landing_buffers", 0, "a positive int"), ("split_embedding_update", "sometimes", "True, False or 'auto'"),
     ("device_row_update", "yes", "True or False"), ("nvme_read_ahead_bytes", -1, "int >= 0")],
)  # fmt: skip
def test_bad_engine_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=rf"EngineConfig\({field}=\.\.\.\) must be .*{match}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_optimizers_own_step_ends_the_engines_step(clip):
    # Lightning calls the user's optimizer.step(); its hooks run the engine's step (engine/step.py), so LR schedulers
    # see a real step (no "lr_scheduler.step() before optimizer.step()" warning) and the hooks go when training ends
    import warnings

    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", gradient_clip_val=clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, trained = fit(module, SlideFormerStrategy(num_slots=2), gradient_clip_val=clip)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    optimizer = trained.trainer.optimizers[0]
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _TwoOptimizers(StackLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.blocks.parameters()), torch.optim.AdamW(self.net.head.parameters())


class _Manual(StackLM):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _RMSprop(StackLM):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters())


class _NoStack(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


@pytest.mark.parametrize(
    ("module", "strategy", "kwargs", "error", "match"),
    [
        (_TwoOptimizers, {}, {}, RuntimeError, "multiple optimizers"),
        (_Manual, {}, {}, ValueError, "automatic optimization only"),
        (_RMSprop, {}, {}, TypeError, "supports torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD"),
        (_NoStack, {}, {}, ValueError, "could not find the stack of transformer blocks"),
        (StackLM, {"blocks": "net.nowhere"}, {}, ValueError, "no such submodule"),
        (StackLM, {"blocks": "net.head"}, {}, ValueError, "must name a non-empty nn.ModuleList"),
        (StackLM, {"update_schedule": "backward"}, {"gradient_clip_val": 1.0}, ValueError, "update_schedule='forward'"),
        (StackLM, {"on_nonfinite": "skip"}, {}, ValueError, "needs the global gradient norm"),
        (
            StackLM,
            {"on_nonfinite": "skip"},
            {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"},
            ValueError,
            "which clipping by value does not compute",
        ),  # fmt: skip
        (lambda: CausalLM(tiny_config("llama")), {"attention": "slide"}, {}, ValueError, "head dim 8 \\(supported"),
    ],
)
def test_bad_setups_fail_before_anything_moves(module, strategy, kwargs, error, match):
    model = module()
    before = {k: (v.data_ptr(), v.device) for k, v in model.state_dict().items()}
    trainer = _trainer(strategy=SlideFormerStrategy(**strategy), max_steps=1, **kwargs)
    with pytest.raises(error, match=match):
        trainer.fit(model, _loader())
    after = {k: (v.data_ptr(), v.device) for k, v in model.state_dict().items()}
    assert after == before  # not moved, not re-allocated (pinned) before the error


def test_hf_gradient_checkpointing_is_off_while_training_and_restored_after():
    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", steps=3)
    module.model.gradient_checkpointing_enable()
    flags = {name for name, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True}
    assert flags
    seen = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append(any(getattr(m, "gradient_checkpointing", False) for m in pl_module.modules()))

    ours, trained = fit(module, SlideFormerStrategy(num_slots=2), steps=3, callbacks=[Look()])
    assert seen == [False] * 3  # the engine recomputes blocks itself
    assert {n for n, m in trained.named_modules() if getattr(m, "gradient_checkpointing", False) is True} == flags
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_the_model_is_left_as_given_after_an_exception():
    # what the strategy switches while it trains (gradient checkpointing, use_cache, the modules' forwards, the loss)
    # comes back when training_step raises, as after fit
    class Fails(CausalLM):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("user error in training_step")

    module = Fails(tiny_config("llama"))
    module.model.gradient_checkpointing_enable()
    before = {k: (v.dtype, v.device, v.clone()) for k, v in module.state_dict().items()}
    trainer = _trainer(strategy=SlideFormerStrategy(num_slots=2), max_steps=1)
    with pytest.raises(RuntimeError, match="user error"):
        trainer.fit(module, _loader())
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
    assert module.model.config.use_cache
    assert not [name for name, m in module.named_modules() if "forward" in m.__dict__]
    for k, v in module.state_dict().items():
        assert (v.dtype, v.device) == before[k][:2]
        assert torch.equal(v, before[k][2])


def _attention_seen():
    seen = set()

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.add(pl_module.model.config._attn_implementation)

    return seen, Look()


def _head_dim_16():
    return CausalLM(tiny_config("llama", hidden_size=64, intermediate_size=128, head_dim=16))


@pytest.mark.slow
def test_slide_attention_training_matches_plain_sdpa():
    module = _head_dim_16()
    ref, _ = fit(module, "auto", steps=3)
    seen, look = _attention_seen()
    ours, trained = fit(module, SlideFormerStrategy(num_slots=2, attention="slide"), steps=3, callbacks=[look])
    assert seen == {"slide"}
    assert trained.model.config._attn_implementation == "sdpa"  # restored when training ended
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


@pytest.mark.gpu
def test_auto_attention_on_cuda_bf16_is_slide_and_within_twice_plain_bf16_error():
    module = _head_dim_16()
    ref32, _ = fit(module, "auto", accelerator="gpu", steps=3)
    plain16, _ = fit(module, "auto", accelerator="gpu", precision="bf16-mixed", steps=3)
    seen, look = _attention_seen()
    ours16, _ = fit(module, streamed(num_slots=2), accelerator="gpu", precision="bf16-mixed", steps=3,
                    callbacks=[look])  # fmt: skip
    assert seen == {"slide"}
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


def test_checkpoints_are_streamed_atomic_and_loaded_without_pickled_code(tmp_path, monkeypatch):
    import lightning.fabric.utilities.cloud_io as cloud_io

    from lightning_slide.checkpoint_io import SlideCheckpointIO

    def in_memory_copy(*args, **kwargs):
        raise AssertionError("the checkpoint was serialized into memory first")

    monkeypatch.setattr(cloud_io, "_atomic_save", in_memory_copy)  # Lightning's default path
    io = SlideCheckpointIO()
    path = tmp_path / "run" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "step": 1}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(3))

    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        real_save({"half": torch.zeros(1000)}, f)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert io.load_checkpoint(path)["step"] == 1  # the previous checkpoint is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no partial file left

    class Payload:
        def __reduce__(self):
            return (print, ("arbitrary code ran",))

    real_save({"evil": Payload()}, tmp_path / "evil.ckpt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        io.load_checkpoint(tmp_path / "evil.ckpt")


def test_the_strategy_checkpoints_through_slide_checkpoint_io():
    from lightning_slide.checkpoint_io import SlideCheckpointIO

    assert isinstance(SlideFormerStrategy().checkpoint_io, SlideCheckpointIO)


def test_out_of_memory_in_training_names_the_settings_that_help(monkeypatch):
    module = StackLM()
    calls = []

    def oom(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # a few blocks into the forward
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return original(*args, **kwargs)

    import lightning_slide.engine.functions as functions

    original = functions._Call.run
    monkeypatch.setattr(functions._Call, "run", oom)
    with pytest.raises(torch.OutOfMemoryError) as info:
        fit(module, SlideFormerStrategy(num_slots=2, offload_activations=False))
    message = str(info.value)
    assert "Tried to allocate 2.00 GiB" in message
    for setting in ("offload_activations=True", "num_slots=2", "accumulate_grad_batches", "expandable_segments"):
        assert setting in message


def test_out_of_memory_at_the_end_of_the_step_is_explained_too(monkeypatch):
    # schedule "forward" sends the embedding's touched rows and their optimizer state up at the step's end
    # (embedding.py)
    from lightning_slide.engine.embedding import EmbeddingRows

    def oom(self, split):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr(EmbeddingRows, "_row_state", oom)
    with pytest.raises(torch.OutOfMemoryError, match="(?s)Tried to allocate 1.00 GiB.*ran out of GPU memory"):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2), steps=3, gradient_clip_val=0.5)


@pytest.mark.parametrize(("budget", "slots"), [(None, 3), (1 << 40, 3), (1 << 29, 2)])  # 3 slots: ~0.2 GiB
def test_auto_window_is_three_slots_unless_they_crowd_the_gpu(monkeypatch, budget, slots):
    import lightning_slide.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "device_budget", lambda device: budget)  # None: the CPU
    seen = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.engine.num_slots)

    fit(StackLM(), streamed(), steps=1, callbacks=[Look()])
    assert seen == [slots]


@pytest.mark.parametrize(("slots", "advice"), [(3, r"Lower SlideFormerStrategy\(num_slots=...\)"), (2, "Free GPU")])
def test_a_window_beyond_the_gpu_budget_is_refused_naming_what_helps(monkeypatch, slots, advice):
    from lightning_slide.engine import machine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1024)  # what a full GPU would report
    with pytest.raises(torch.OutOfMemoryError, match=rf"window of {slots} block slots.*{advice}"):
        fit(StackLM(), SlideFormerStrategy(num_slots=slots), steps=1)
