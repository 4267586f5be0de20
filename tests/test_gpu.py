"""GPU tests (run on the GPU machine): equivalence on CUDA, a model that exposes missing stream synchronization,
and errors raised before memory is pinned."""

import pytest
import torch

from helpers import (
    CausalLM,
    StackLM,
    count_deferred_gathers,
    fit,
    global_error,
    max_rel_error,
    streamed,
    tiny_config,
    token_data,
)
from lightning_slide.engine import EngineConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("tied", "clip", "accumulate", "schedule"),
    [(False, None, 1, "auto"), (True, 0.05, 2, "auto"), (False, None, 2, "auto"), (True, 0.05, 1, "norm-first")],
)
def test_cuda_fp32_matches_plain(tied, clip, accumulate, schedule):
    module = CausalLM(tiny_config("llama", tied=tied))
    kwargs = dict(accelerator="gpu", gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    ref, _ = fit(module, "auto", **kwargs)
    ours, _ = fit(module, streamed(num_slots=2, update_schedule=schedule), **kwargs)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


@pytest.mark.parametrize("clip", [None, 0.05])
def test_cuda_bf16_within_twice_plain_bf16_error(clip):
    module = CausalLM(tiny_config("qwen3", tied=True))
    ref32, _ = fit(module, "auto", accelerator="gpu", gradient_clip_val=clip)
    plain16, _ = fit(module, "auto", accelerator="gpu", precision="bf16-mixed", gradient_clip_val=clip)
    ours16, _ = fit(module, streamed(num_slots=2), accelerator="gpu", precision="bf16-mixed",
                    gradient_clip_val=clip)  # fmt: skip
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


def _low_intensity_run(strategy, clip):
    # Large weights, almost no compute (8 tokens per step): copies dominate, so a kernel that ran before its
    # weights (or gradients) finished moving changes the result. SGD: no Adam amplification of float noise
    # (with 4-token sequences some gradients are exactly zero, and Adam turns their rounding into updates).
    config = tiny_config("llama", layers=10, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                         num_key_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    module = CausalLM(config, optimizer="sgd", lr=0.05)
    kwargs = dict(accelerator="gpu", gradient_clip_val=clip, data=token_data(8, seq=4), batch_size=2, steps=4)
    return fit(module, "auto", **kwargs)[0], fit(module, strategy, **kwargs)[0]


@pytest.mark.parametrize(
    ("clip", "schedule", "deferred"), [(None, "auto", 0), (1.0, "auto", 0), (1.0, "norm-first", 0), (None, "auto", 6)]
)
def test_low_arithmetic_intensity_exposes_missing_synchronization(clip, schedule, deferred):
    config = EngineConfig(deferred_updates=deferred)  # the first blocks updated during the next forward
    ref, ours = _low_intensity_run(streamed(num_slots=2, update_schedule=schedule, engine=config), clip)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_deferred_embedding_rows_on_cuda_match(monkeypatch):
    # embedding.py, "backward" schedule: the touched rows' update waits for the next gather, which sends the other
    # rows while the worker updates those it reads, then those
    gathers = count_deferred_gathers(monkeypatch)
    split = EngineConfig(split_embedding_update=True)
    ref, ours = _low_intensity_run(streamed(num_slots=2, update_schedule="backward", engine=split), None)
    assert sum(gathers) == 3  # steps 2 to 4
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


@pytest.mark.parametrize("clip", [None, 1.0])
def test_activation_offload_on_cuda_matches(clip):
    ref, ours = _low_intensity_run(streamed(num_slots=2, offload_activations=True), clip)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def _busy_run(layers: int):
    # large activations and matmuls at 4 x 1024 tokens: the compute stream runs far behind the host
    config = tiny_config("llama", layers=layers, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    module = CausalLM(config, optimizer="sgd", lr=0.05)
    return module, dict(accelerator="gpu", data=token_data(8, seq=1024), batch_size=4, steps=2)


def test_activation_offload_with_busy_compute_stream_matches():
    # the opposite regime: large activations and matmuls, so the compute stream runs far behind the host and
    # freed activation memory is handed out again while kernels still read it (the fetch must wait for them)
    module, kwargs = _busy_run(layers=6)
    ref, _ = fit(module, "auto", **kwargs)
    ours, _ = fit(module, streamed(num_slots=2, offload_activations=True), **kwargs)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_low_intensity_check_detects_a_missing_wait(monkeypatch):
    from lightning_slide import NonFiniteGradientError
    from lightning_slide.engine.transfer import Transfer

    monkeypatch.setattr(Transfer, "wait", lambda self, event: None)  # compute no longer waits for copies
    try:
        ref, ours = _low_intensity_run(streamed(num_slots=2), None)
    except NonFiniteGradientError:
        return  # half-copied weights made NaN gradients: caught too
    err, _ = max_rel_error(ours, ref)
    assert err > 1e-3


def test_dropout_model_on_cuda_matches():
    module = StackLM(dropout=0.3)
    ref, _ = fit(module, "auto", accelerator="gpu")
    ours, _ = fit(module, streamed(num_slots=2), accelerator="gpu")
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_masters_are_pinned_and_buffers_on_gpu_during_training():
    import lightning as L

    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen["pinned"] = all(p.is_pinned() and p.device.type == "cpu" for p in module.parameters())
            seen["buffers"] = {b.device.type for b in module.buffers()}

    fit(CausalLM(tiny_config("llama")), streamed(), accelerator="gpu", steps=1, callbacks=[Look()])
    assert seen == {"pinned": True, "buffers": {"cuda"}}


def test_bad_optimizer_fails_before_pinning():
    class Bad(StackLM):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters())

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    model = Bad()
    trainer = L.Trainer(strategy=streamed(), accelerator="gpu", devices=1, max_steps=1, logger=False)
    with pytest.raises(TypeError, match="supports torch.optim.AdamW"):
        trainer.fit(model, DataLoader(TensorDataset(token_data()), batch_size=4))
    assert not any(p.is_pinned() for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())


def test_precision_follows_the_trainer_on_cuda():
    import lightning as L

    strategy = L.Trainer(strategy="slideformer", accelerator="gpu", precision="bf16-mixed", logger=False).strategy
    assert strategy.precision_plugin.precision == "bf16-mixed"
    assert strategy.root_device.type == "cuda"
    default = L.Trainer(strategy="slideformer", accelerator="gpu", devices=1, logger=False).strategy
    assert default.precision_plugin.precision == "32-true"  # Lightning's default


def test_cpu_run_on_a_cuda_machine_autocasts_on_the_cpu():
    # the precision plugin is made before the accelerator is known; a CPU bf16 run must not autocast for CUDA
    module = CausalLM(tiny_config("llama"))
    ref32, _ = fit(module, "auto", accelerator="cpu")
    plain16, _ = fit(module, "auto", accelerator="cpu", precision="bf16-mixed")
    ours16, _ = fit(module, streamed(num_slots=2), accelerator="cpu", precision="bf16-mixed")
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


def test_window_that_does_not_fit_names_the_setting(monkeypatch):
    torch.cuda.empty_cache()  # cached blocks count as free to the window check
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 30))  # 1 MiB free
    with pytest.raises(torch.OutOfMemoryError, match=r"num_slots=\.\.\.\) \(minimum 2\)"):
        fit(CausalLM(tiny_config("llama")), streamed(num_slots=3), accelerator="gpu", steps=1)
    with pytest.raises(torch.OutOfMemoryError, match=r"window of 2 block slots.*Free GPU memory"):
        fit(CausalLM(tiny_config("llama")), streamed(), accelerator="gpu", steps=1)  # "auto": 2


def test_pinning_failure_is_a_clear_error(monkeypatch):
    from lightning_slide import PinnedMemoryError

    real_empty = torch.empty

    def no_pinning(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (simulated)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    with pytest.raises(PinnedMemoryError, match="ulimit -l"):
        fit(CausalLM(tiny_config("llama")), streamed(), accelerator="gpu", steps=1)


def test_registered_host_memory_trains_exactly_and_is_released(monkeypatch):
    import lightning as L

    from lightning_slide.engine import transfer

    calls = {"register": 0, "unregister": 0}

    def counted(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(transfer, "_cuda_register", counted("register", transfer._cuda_register))
    monkeypatch.setattr(transfer, "_cuda_unregister", counted("unregister", transfer._cuda_unregister))
    registered = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            registered.append(len(trainer.strategy.engine.transfer._registered))

    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", accelerator="gpu")
    strategy = streamed(num_slots=2, engine=EngineConfig(register_min_bytes=0))  # every buffer registered
    ours, _ = fit(module, strategy, accelerator="gpu", callbacks=[Look()])
    assert registered
    assert min(registered) > 0
    assert calls["register"] == calls["unregister"] > 0  # all released at teardown
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_registration_failure_is_a_clear_error(monkeypatch):
    from lightning_slide import PinnedMemoryError
    from lightning_slide.engine import transfer

    monkeypatch.setattr(transfer, "_cuda_register", lambda ptr, nbytes: 2)  # cudaErrorMemoryAllocation
    strategy = streamed(engine=EngineConfig(register_min_bytes=0))
    with pytest.raises(PinnedMemoryError, match="ulimit -l"):
        fit(CausalLM(tiny_config("llama")), strategy, accelerator="gpu", steps=1)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_tiled_mlps_on_cuda_match(monkeypatch, precision):
    # every input offloaded and the MLPs tiled (a GPU too small for one block at work), with real streams
    from lightning_slide.engine import machine
    from lightning_slide.engine.engine import SlideEngine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1)
    monkeypatch.setattr(SlideEngine, "device_bytes", lambda self, num_slots=None: 0)  # window fits
    module, kwargs = _busy_run(layers=4)
    ref, _ = fit(module, "auto", **kwargs)
    ours, _ = fit(module, streamed(num_slots=2), precision=precision, **kwargs)
    if precision == "32-true":
        err, where = max_rel_error(ours, ref)
        assert err < 1e-5, f"{where}: {err:.2e}"
    else:
        plain16, _ = fit(module, "auto", precision="bf16-mixed", **kwargs)
        assert global_error(ours, ref) <= 2 * global_error(plain16, ref)


def test_nvme_on_cuda_trains_like_ram(tmp_path):
    # a tolerance (the CPU tests check bitwise equality; test_cuda_runs_are_bitwise_reproducible, run-to-run noise)
    module = CausalLM(tiny_config("llama", tied=True))
    ram, _ = fit(module, streamed(num_slots=2), accelerator="gpu")
    disk, _ = fit(module, streamed(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path)),
                  accelerator="gpu")  # fmt: skip
    err, where = max_rel_error(disk, ram)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_cuda_runs_are_bitwise_reproducible():
    # as plain training is on CUDA; summing embedding-row gradients with index_add_ (atomics) made two runs differ
    module = CausalLM(tiny_config("llama", tied=True))
    first, _ = fit(module, streamed(num_slots=2), accelerator="gpu")
    second, _ = fit(module, streamed(num_slots=2), accelerator="gpu")
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_nvme_masters_on_cuda_train_like_ram(tmp_path):
    module = CausalLM(tiny_config("llama"))
    kwargs = dict(accelerator="gpu", precision="bf16-mixed")
    ram, _ = fit(module, streamed(num_slots=2), **kwargs)
    disk, _ = fit(module, streamed(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path),
                                              nvme_masters=True), **kwargs)  # fmt: skip
    err, where = max_rel_error(disk, ram)
    assert err < 1e-5, f"{where}: {err:.2e}"


def test_moe_aux_loss_and_a_peft_embedding_on_cuda_match():
    # the guard's carried router logits and a peft layer streamed whole, on the device
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)  # fmt: skip
    module = CausalLM(config)
    module.model = get_peft_model(module.model, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    kwargs = dict(accelerator="gpu", gradient_clip_val=0.5, accumulate_grad_batches=2, steps=4)
    ref, _ = fit(module, "auto", **kwargs)
    ours, _ = fit(module, streamed(num_slots=2), **kwargs)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
