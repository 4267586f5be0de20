"""The engine's machinery under a real Trainer on the CPU: slot reuse, no full logits, faults, evaluation loops,
checkpoints."""

import math
import threading
import time
from dataclasses import replace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_slide.kernels.linear_cross_entropy as flce
from helpers import (
    SEQ,
    VOCAB,
    CausalLM,
    LargestTensor,
    NaNIntoEmbedding,
    StackLM,
    count_deferred_gathers,
    fit,
    global_error,
    max_rel_error,
    record_splits,
    streamed,
    tiny_config,
    token_data,
)
from lightning_slide import NonFiniteGradientError, SlideFormerStrategy
from lightning_slide.engine import EngineConfig


class _Probe(L.Callback):
    """Records the engine's ring storage and upload count at every training batch."""

    def __init__(self):
        self.ring_ptrs, self.uploads = [], []

    def on_train_batch_end(self, trainer, *args):
        engine = trainer.strategy.engine
        self.ring_ptrs.append(tuple(t.data_ptr() for buf in engine.window.ring for t in buf.flat.values()))
        self.uploads.append(engine.window.stats.uploads)


def test_window_slots_are_preallocated_and_reused():
    probe = _Probe()
    fit(CausalLM(tiny_config("llama", layers=5)), SlideFormerStrategy(num_slots=3), steps=4, callbacks=[probe])
    assert len(probe.ring_ptrs[0]) == 3  # one bf16/fp32 flat per slot: 3 slots, fp32 run -> one dtype each
    assert len(set(probe.ring_ptrs)) == 1  # the same memory every step: no allocation per step
    per_step = [b - a for a, b in zip(probe.uploads, probe.uploads[1:])]
    assert min(per_step) > 5  # 5 blocks through 3 slots: blocks are re-sent every step


class _WatchSteps(L.Callback):
    def __init__(self):
        self.mode = LargestTensor()

    def on_train_batch_start(self, *args):
        self.mode.__enter__()

    def on_train_batch_end(self, *args):
        self.mode.__exit__(None, None, None)


@pytest.mark.triton_loss
@pytest.mark.parametrize("install_loss", [True, False])
def test_no_full_logits_in_a_training_step(tune, install_loss):
    # chunk the tiny vocabulary (two passes) and its tokens (one pass: 8 chunks) too
    tune(flce, chunk_elements=1000, min_chunk_cols=1, one_pass_chunk_elements=1, min_chunk_rows=1)
    watch = _WatchSteps()
    batch = 4
    fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(install_loss=install_loss), steps=2, callbacks=[watch])
    full_logits = 4 * batch * SEQ * VOCAB  # bytes, fp32
    if install_loss:
        assert 0 < watch.mode.largest < full_logits
    else:  # the watcher does see the logits when Hugging Face's own loss runs
        assert watch.mode.largest >= full_logits


class _NaNAt(CausalLM):
    def __init__(self, *args, bad_step=2, skip=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad_step, self.skip = bad_step, skip

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.bad_step:
            return None if self.skip else loss * float("nan")
        return loss


class _KeepModule(L.Callback):
    def __init__(self, kept: list):
        self.kept = kept

    def on_exception(self, trainer, module, exception):
        trainer.strategy.engine.wait = lambda: None  # the worker has failed: nothing more to complete
        self.kept.append(module)


@pytest.mark.parametrize(
    ("clip", "accumulate", "schedule", "precision"),
    [
        (None, 1, "auto", "32-true"),
        (1.0, 1, "auto", "32-true"),
        (None, 2, "auto", "32-true"),
        (None, 1, "forward", "32-true"),
        (None, 1, "forward", "bf16-mixed"),  # retained in bf16 (EngineConfig.compact_retained_grads)
    ],
)
def test_nonfinite_gradient_stops_with_step_and_block(clip, accumulate, schedule, precision):
    # streamed (checked on the device), clipped (the global norm), retained (checked on the host, updates.py; with
    # "forward", the embedding's touched rows first)
    strategy = SlideFormerStrategy(num_slots=2, update_schedule=schedule,
                                   engine=EngineConfig(compact_retained_grads=True))  # fmt: skip
    with pytest.raises(NonFiniteGradientError, match="optimizer step 2 in '(model|the global)"):
        fit(_NaNAt(tiny_config("llama")), strategy, steps=4, gradient_clip_val=clip,
            accumulate_grad_batches=accumulate, precision=precision)  # fmt: skip


class _Retained(L.Callback):
    """Records the names of the parameters with a retained gradient buffer on the host at every training batch."""

    def __init__(self):
        self.names = []

    def on_train_batch_end(self, trainer, module, *args):
        host = trainer.strategy.engine.updates.host
        self.names.append({n for n, p in module.named_parameters() if p in host})


@pytest.mark.parametrize(("deferred", "accumulate", "precision"), [(2, 1, "32-true"), (4, 2, "32-true"),
                                                                   (1, 1, "bf16-mixed")])  # fmt: skip
def test_deferred_block_updates_train_as_plain_lightning(deferred, accumulate, precision):
    # the first blocks are updated while the next forward runs (EngineConfig.deferred_updates): the same training;
    # only their gradients wait on the host (all, with accumulation)
    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", accumulate_grad_batches=accumulate)
    retained = _Retained()
    strategy = streamed(num_slots=2, engine=EngineConfig(deferred_updates=deferred))
    ours, _ = fit(module, strategy, accumulate_grad_batches=accumulate, callbacks=[retained], precision=precision)
    if precision == "32-true":
        err, where = max_rel_error(ours, ref)
        assert err < 1e-5, f"{where}: {err:.2e}"
    else:
        plain, _ = fit(module, "auto", accumulate_grad_batches=accumulate, precision=precision)
        assert global_error(ours, ref) <= 2 * global_error(plain, ref)
    blocks = tuple(f"model.model.layers.{i}." for i in range(deferred))
    assert retained.names[-1] == {n for n, _ in module.named_parameters() if accumulate > 1 or n.startswith(blocks)}


def test_deferred_updates_belong_to_the_backward_schedule():
    with pytest.raises(ValueError, match="variant of update_schedule='backward'"):
        fit(CausalLM(tiny_config("llama")), streamed(engine=EngineConfig(deferred_updates=1)), gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="more blocks than the 4"):
        fit(CausalLM(tiny_config("llama")), streamed(engine=EngineConfig(deferred_updates=5)))
    with pytest.raises(ValueError, match="deferred_updates=...\\) must be 'auto' or an int"):
        EngineConfig(deferred_updates=-1)


class _NaNInFirstMicroBatch(CausalLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == 2 and batch_idx % 2 == 0 else loss


def test_nonfinite_gradient_of_an_earlier_micro_batch_stops_the_streamed_update():
    # the window's last backward streams the accumulated sums to their update: a NaN that only an earlier micro-batch
    # brought is in the sums, not in the last contributions
    kept = []
    with pytest.raises(NonFiniteGradientError, match="optimizer step 2 in 'model"):
        fit(_NaNInFirstMicroBatch(tiny_config("llama")), streamed(num_slots=2, update_schedule="backward"), steps=4,
            accumulate_grad_batches=2, callbacks=[_KeepModule(kept)])  # fmt: skip
    assert all(torch.isfinite(p).all() for p in kept[0].parameters())


class _Branch(torch.nn.Module):
    def __init__(self, core: torch.nn.Module):
        super().__init__()
        self.core, self.extra, self.use_extra = core, torch.nn.Linear(16, 16), True

    def forward(self, x):
        return self.core(x) + self.extra(x) if self.use_extra else self.core(x)


class _SometimesStack(StackLM):
    """Block 1 has a branch that only even micro-batches use, and block 3 runs only in even micro-batches: in the
    window's last backward, some retained gradients have no contribution, and one unit has none at all."""

    def __init__(self):
        super().__init__(dropout=0.0)
        self.net.blocks[1] = _Branch(self.net.blocks[1])

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        net, even = self.net, batch_idx % 2 == 0
        net.blocks[1].use_extra = even
        x = net.embed(ids)
        for i, block in enumerate(net.blocks):
            if i != 3 or even:
                x = x + block(x)
        logits = net.head(net.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_accumulated_gradients_without_a_last_contribution_are_applied():
    module = _SometimesStack()
    kwargs = dict(accumulate_grad_batches=2, steps=3)
    ref, _ = fit(module, "auto", **kwargs)
    ours, _ = fit(module, streamed(num_slots=2, update_schedule="backward"), **kwargs)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
    moved, _ = max_rel_error(ref, {k: v.float() for k, v in module.state_dict().items()})
    assert moved > 1e-2


def test_nonfinite_step_can_be_skipped_with_clipping():
    config = tiny_config("llama")
    nan_module = _NaNAt(config)
    skip_module = _NaNAt(config, skip=True)  # plain Lightning: returning None skips the update
    skip_module.load_state_dict(nan_module.state_dict())
    ref, plain = fit(skip_module, "auto", steps=4, gradient_clip_val=1.0)
    ours, trained = fit(nan_module, SlideFormerStrategy(on_nonfinite="skip"), steps=4, gradient_clip_val=1.0)
    err, where = max_rel_error(ours, ref)
    assert all(torch.isfinite(v).all() for v in ours.values())
    assert err < 1e-5, f"{where}: {err:.2e}"
    # no other trace either: the step counters and Adam's state are those of a step whose training_step returned None
    assert trained.trainer.global_step == plain.trainer.global_step == 4
    theirs = plain.trainer.optimizers[0].state_dict()["state"]
    mine = trained.trainer.optimizers[0].state_dict()["state"]
    assert {i: float(s["step"]) for i, s in mine.items()} == {i: float(s["step"]) for i, s in theirs.items()}
    for key in ("exp_avg", "exp_avg_sq"):
        err, where = max_rel_error({i: s[key] for i, s in mine.items()}, {i: s[key] for i, s in theirs.items()})
        assert err < 1e-5, f"{key} {where}: {err:.2e}"


def test_validation_test_and_predict_loops():
    module = CausalLM(tiny_config("qwen3"))
    data = DataLoader(TensorDataset(token_data(8, seed=3)), batch_size=4)
    results = {}
    for name, strategy in [("plain", "auto"), ("ours", SlideFormerStrategy(num_slots=2))]:
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, val_check_interval=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        model = CausalLM(tiny_config("qwen3"))
        model.load_state_dict(module.state_dict())
        trainer.fit(model, DataLoader(TensorDataset(token_data()), batch_size=4), data)
        val = trainer.callback_metrics["val_loss"].item()
        test = trainer.validate(model, data, verbose=False)[0]["val_loss"]
        results[name] = (val, test)
    assert math.isclose(results["ours"][0], results["plain"][0], rel_tol=1e-5)
    assert math.isclose(results["ours"][1], results["plain"][1], rel_tol=1e-5)


def test_predict_on_a_plain_model_returns_logits():
    module = StackLM()
    ids = token_data(4, seed=5)

    class Predict(StackLM):
        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    model = Predict()
    model.load_state_dict(module.state_dict())
    with torch.no_grad():
        expected = model.eval().net(ids)
    trainer = L.Trainer(strategy=SlideFormerStrategy(num_slots=2), accelerator="cpu", logger=False)
    (out,) = trainer.predict(model, DataLoader(TensorDataset(ids), batch_size=4))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_order_of_uploads_at_each_training_gather(monkeypatch, clip):
    # the forward needs the rows and block 0 first: each training gather sends block 0 before the rows, and the
    # window's next block goes up once block 0's forward is queued (EmbeddingRows.gather), where the embedding's
    # update is split; but with the "backward" schedule the rows wait for the deferred update's first part
    # (embedding.py), and block 1 goes up meanwhile, between the rows that update does not touch and those it does
    from lightning_slide.engine.embedding import EmbeddingRows
    from lightning_slide.engine.window import Window

    events, upload, send, gather = [], Window._upload, EmbeddingRows.send_host_rows, EmbeddingRows.gather

    def logged_upload(self, unit, buf):
        events.append(self.index.get(unit, "other"))
        upload(self, unit, buf)

    def logged_send(self, source, index, out):
        events.append("rows")
        send(self, source, index, out)

    def logged_gather(self, *args, **kwargs):
        events.append("[")
        out = gather(self, *args, **kwargs)
        events.append("]")
        return out

    monkeypatch.setattr(Window, "_upload", logged_upload)
    monkeypatch.setattr(EmbeddingRows, "send_host_rows", logged_send)
    monkeypatch.setattr(EmbeddingRows, "gather", logged_gather)
    strategy = SlideFormerStrategy(num_slots=3, engine=EngineConfig(split_embedding_update=True))
    fit(CausalLM(tiny_config("llama")), strategy, steps=3, gradient_clip_val=clip)
    gathers = "".join(str(e) for e in events).split("[")[1:]
    assert len(gathers) == 3
    # each step's blocks 0 and 1 were updated: both go up. Step 1 has no deferred update
    deferred = [clip is None and step > 0 for step in range(3)]
    assert all(g.startswith("0rows1rows]" if d else "0rows]1") for g, d in zip(gathers, deferred)), gathers


@pytest.mark.parametrize(("tied", "clip"), [pytest.param(True, 0.5, marks=pytest.mark.slow), (False, 0.5),
                                            pytest.param(False, None, marks=pytest.mark.slow)])  # fmt: skip
def test_checkpoint_and_resume_at_epoch_end_continue_exactly(tmp_path, tied, clip):
    # the embedding's update split in two (embedding.py). Clipping: schedule "forward"; untied, its touched rows are
    # updated on the device, so the checkpoint must wait for their write-back. No clipping: "backward", where the last
    # step's touched rows wait for the next gather, so the checkpoint must update them first
    def strategy():
        return SlideFormerStrategy(num_slots=2, engine=EngineConfig(split_embedding_update=True))

    module = CausalLM(tiny_config("llama", tied=tied))
    straight, _ = fit(module, strategy(), steps=8, gradient_clip_val=clip)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=4)
    fit(
        module,
        strategy(),
        steps=4,
        gradient_clip_val=clip,
        callbacks=[ckpt],
        enable_checkpointing=True,
    )  # fmt: skip  (4 steps = one epoch of 4 batches)
    path = next(tmp_path.glob("*.ckpt"))
    saved = torch.load(path, weights_only=True)
    assert saved["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "cpu"
    resumed, _ = fit(module, strategy(), steps=8, gradient_clip_val=clip, ckpt_path=str(path))
    err, where = max_rel_error(resumed, straight)
    assert err < 1e-6, f"{where}: {err:.2e}"


class _PooledInputs(L.Callback):
    """Records how many block inputs went through the engine's host pool."""

    def __init__(self):
        self.pooled = []

    def on_train_end(self, trainer, module):
        self.pooled.append(sum(len(v) for v in trainer.strategy.engine.activations._free.values()))


@pytest.mark.parametrize(("clip", "accumulate"), [(None, 1), (0.5, 2)])
def test_activation_offload_gives_the_same_training(clip, accumulate):
    look = _PooledInputs()
    module = StackLM(dropout=0.2)  # dropout: the recompute replays the RNG on restored inputs
    kwargs = dict(gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    ref, _ = fit(module, "auto", **kwargs)
    kept, _ = fit(module, SlideFormerStrategy(num_slots=2), **kwargs)
    moved, _ = fit(module, SlideFormerStrategy(num_slots=2, offload_activations=True), callbacks=[look], **kwargs)
    assert look.pooled[0] > 0  # block inputs went through the host pool
    assert all(torch.equal(moved[k], kept[k]) for k in kept)  # copies are exact
    err, where = max_rel_error(moved, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _TrainingBuffers(L.Callback):
    """As training ends: the engine, and weak references to its training-only host buffers (the retained
    gradients, the offloaded inputs' pool, the embedding rows' buffers)."""

    def on_train_end(self, trainer, module):
        import weakref

        engine = self.engine = trainer.strategy.engine
        rows = engine.rows
        buffers = [
            *engine.updates.host.values(),
            *(raw for pooled in engine.activations._free.values() for raw, _ in pooled),
            *([rows._rows_grad] if rows._rows_grad is not None else []),
            *(stage[0] for stage in rows._stage if stage is not None),
            *rows._scratch.values(),
        ]
        self.refs = [weakref.ref(t._base if t._base is not None else t) for t in buffers]


def test_training_buffers_leave_the_host_before_the_state_comes_back_after_fit():
    # at teardown the resident units' weights and (in Lightning's teardown) all optimizer state come to the host:
    # what only training used must be gone by then, or the host's peak after fit adds them
    import gc

    look = _TrainingBuffers()
    fit(CausalLM(tiny_config()), streamed(num_slots=2, offload_activations=True), callbacks=[look],
        gradient_clip_val=0.5, accumulate_grad_batches=2)  # fmt: skip
    gc.collect()
    assert look.engine is not None  # the engine is alive: only its teardown can have let them go
    assert len(look.refs) > 2
    alive = [ref() for ref in look.refs if ref() is not None]
    assert not alive, f"{len(alive)} of {len(look.refs)} training buffers outlived the teardown"


def test_offloaded_inputs_are_freed_after_their_block_backward():
    # the autograd node keeps its stash entries until the whole backward ends; the fetched inputs must not live
    # that long (on the H200, 22 blocks' inputs piled up to 11 GiB at 32k tokens and ran out of memory)
    import weakref

    from lightning_slide.engine.activations import ActivationStash
    from lightning_slide.engine.transfer import Transfer

    stash = ActivationStash(Transfer(torch.device("cpu"), chunk_numel=64, landing_buffers=0))
    saved = [stash.save((torch.randn(4, 8, requires_grad=True),)) for _ in range(3)]
    for entries in reversed(saved):  # backward order
        (back,) = stash.load(entries)
        gone = weakref.ref(back)
        del back
        assert gone() is None


@pytest.mark.parametrize(("budget", "offloads"), [(1 << 40, False), (1 << 10, True), (None, False)])
def test_auto_activation_offload_follows_the_gpu_budget(monkeypatch, caplog, budget, offloads):
    # the budget a GPU would report (None: the CPU); "auto" offloads when the saved inputs would crowd it out
    from lightning_slide.engine import machine
    from lightning_slide.engine.engine import SlideEngine

    monkeypatch.setattr(machine, "device_budget", lambda device: budget)
    monkeypatch.setattr(SlideEngine, "device_bytes", lambda self, num_slots=None: 0)  # window fits
    look = _PooledInputs()
    module = StackLM()
    ref, _ = fit(module, SlideFormerStrategy(num_slots=2, offload_activations=False))
    with caplog.at_level("INFO"):
        ours, _ = fit(module, SlideFormerStrategy(num_slots=2), callbacks=[look])
    assert (look.pooled[0] > 0) == offloads
    assert ("SlideFormer offloads the activations" in caplog.text) == offloads
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_offloading_only_the_first_blocks_gives_the_same_training(monkeypatch):
    from lightning_slide.engine import activations, machine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1 << 40)
    monkeypatch.setattr(activations, "blocks_to_offload", lambda *args: 1)  # what a GPU with room for the rest says
    look = _PooledInputs()
    module = StackLM()
    ref, _ = fit(module, SlideFormerStrategy(num_slots=2, offload_activations=False))
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2), callbacks=[look])
    assert look.pooled == [1]  # one block's input went through the host pool
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_offloaded_inputs_that_would_not_fit_ram_are_a_clear_error(monkeypatch):
    from lightning_slide.engine import machine
    from lightning_slide.engine.engine import SlideEngine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1)  # every input must leave the GPU
    monkeypatch.setattr(SlideEngine, "device_bytes", lambda self, num_slots=None: 0)
    module = CausalLM(tiny_config("llama"))
    adam = 8 * sum(p.numel() for p in module.parameters())  # what Adam's state will take at the first update
    inputs = 4 * 4 * 4 * SEQ * module.model.config.hidden_size  # 4 blocks: fp32 inputs of batches of 4
    monkeypatch.setattr(machine, "available_host_bytes", lambda: adam + inputs)
    fit(module, SlideFormerStrategy(num_slots=2), steps=1)  # just fits
    monkeypatch.setattr(machine, "available_host_bytes", lambda: adam + inputs - 1)
    with pytest.raises(MemoryError, match=r"saved inputs of 4 blocks .* GiB of RAM is available"):
        fit(module, SlideFormerStrategy(num_slots=2), steps=1)


def test_offload_moves_as_few_blocks_as_make_the_rest_fit():
    from lightning_slide.engine.planner import _DEVICE_MARGIN, WORKING_INPUTS, blocks_to_offload

    def budget(kept: int) -> float:  # what keeping `kept` inputs of 10 bytes and one block at work takes
        return ((kept + WORKING_INPUTS) * 10 + 100) / _DEVICE_MARGIN

    assert blocks_to_offload(10, blocks=8, budget=budget(8) + 1, reserved_bytes=100) == 0
    assert blocks_to_offload(10, blocks=8, budget=budget(8) - 1, reserved_bytes=100) == 1
    assert blocks_to_offload(10, blocks=8, budget=budget(3) + 1, reserved_bytes=100) == 5
    assert blocks_to_offload(10, blocks=8, budget=budget(0) - 20, reserved_bytes=100) == 8  # even then all of them
    assert blocks_to_offload(10**12, blocks=8, budget=None, reserved_bytes=0) == 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_tiled_mlps_give_the_same_training(monkeypatch, precision):
    # a GPU too small for one block at work: every input offloaded and the MLPs run on slices of the tokens
    from lightning_slide.engine import machine
    from lightning_slide.engine.engine import SlideEngine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1)
    monkeypatch.setattr(SlideEngine, "device_bytes", lambda self, num_slots=None: 0)  # window fits
    tiled = []

    class Look(L.Callback):
        def on_train_end(self, trainer, module):
            engine = trainer.strategy.engine
            tiled.append((engine.offload.tiling, len(engine.offload.tiled), engine.offload.blocks))

    module = CausalLM(tiny_config("llama", layers=3))
    ref, _ = fit(module, "auto")
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2), precision=precision, callbacks=[Look()])
    assert tiled == [(True, 3, 3)]
    if precision == "32-true":
        err, where = max_rel_error(ours, ref)
        assert err < 1e-5, f"{where}: {err:.2e}"
    else:
        plain16, _ = fit(module, "auto", precision="bf16-mixed")
        assert 0 < global_error(ours, ref) <= 2 * global_error(plain16, ref)


def test_embedding_rows_move_through_two_small_staging_buffers():
    module = CausalLM(tiny_config("llama", tied=True))
    ref, _ = fit(module, "auto")
    three_rows = EngineConfig(rows_stage_numel=3 * module.model.config.hidden_size)
    ours, _ = fit(module, SlideFormerStrategy(num_slots=2, engine=three_rows))
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _LandingPool(L.Callback):
    """Records, when training ends, the landing buffers left in the pool and those the host plan counts (bytes)."""

    def __init__(self):
        self.kept = []

    def on_train_end(self, trainer, module):
        engine = trainer.strategy.engine
        engine.wait()  # the last updates have given their buffers back
        self.kept.append((engine.transfer._landing.qsize(), engine.host_plan().landing))


def test_offloading_runs_keep_fewer_landing_buffers(monkeypatch):
    from lightning_slide.engine import machine
    from lightning_slide.engine.engine import SlideEngine

    monkeypatch.setattr(machine, "device_budget", lambda device: 1)  # every input leaves the GPU
    monkeypatch.setattr(SlideEngine, "device_bytes", lambda self, num_slots=None: 0)
    pool = _LandingPool()
    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto")
    strategy = SlideFormerStrategy(num_slots=2, engine=EngineConfig(offload_landing_buffers=1))
    ours, _ = fit(module, strategy, callbacks=[pool])
    assert pool.kept == [(1, 4 * (1 << 23))]  # one buffer left, and the plan says so
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _FirstBlockTwiceLM(StackLM):
    """Runs its first block twice per step: its weights get two gradients in one backward."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        net = self.net
        x = net.embed(ids)
        for block in [net.blocks[0], *net.blocks]:
            x = x + block(x)
        logits = net.head(net.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_clipping_without_accumulation_keeps_two_landing_buffers_and_shared_weights_train():
    # schedule "forward" retains every gradient, so the landing pool only serves a second gradient of the same
    # weights in one step: here the first block runs twice (weights shared), which takes it. Chunks of 256
    # elements, so the gradients would fill 36 buffers.
    pool = _LandingPool()
    module = _FirstBlockTwiceLM(dropout=0.0)
    ref, _ = fit(module, "auto", gradient_clip_val=0.5)
    strategy = SlideFormerStrategy(num_slots=2, engine=EngineConfig(chunk_numel=256))
    ours, _ = fit(module, strategy, gradient_clip_val=0.5, callbacks=[pool])
    assert pool.kept == [(2, 2 * 4 * 256)]
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _RetainedGrads(L.Callback):
    """Records, after each step, the dtypes of the retained gradient buffers and the parameters still compact."""

    def __init__(self):
        self.dtypes, self.compact = set(), []

    def on_train_batch_end(self, trainer, *args):
        updates = trainer.strategy.engine.updates
        self.dtypes |= {t.dtype for t in updates.host.values()}
        self.compact.append(len(updates.compact))


@pytest.mark.parametrize(
    ("case", "accelerator"),
    [("clip-norm", "cpu"), ("clip-value", "cpu"), ("block-twice", "cpu"),
     pytest.param("clip-norm", "gpu", marks=pytest.mark.gpu)],  # pinned bf16 buffers, the bf16 view of the stage
)  # fmt: skip
def test_bf16_retained_gradients_train_the_same_bits_as_fp32_ones(case, accelerator):
    # schedule "forward" under bf16-mixed keeps the matrices' gradients in bf16, which holds them exactly: training
    # gives the same bits as with fp32 buffers, clipped by norm or by value (after widening). A block that runs twice
    # in a step gets a second gradient, and its buffers become fp32 at the first step. Chunks of 256 elements, so
    # each update widens a gradient in several chunks.
    module = (_FirstBlockTwiceLM if case == "block-twice" else StackLM)(dropout=0.0)
    kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value" if case == "clip-value" else "norm",
              "accelerator": accelerator}  # fmt: skip
    probe = _RetainedGrads()

    def strategy(compact: bool) -> SlideFormerStrategy:  # forced: "auto" would keep fp32 where it fits
        return streamed(num_slots=2, engine=EngineConfig(chunk_numel=256, compact_retained_grads=compact))

    compact, _ = fit(module, strategy(True), precision="bf16-mixed", callbacks=[probe], **kwargs)
    wide, _ = fit(module, strategy(False), precision="bf16-mixed", **kwargs)
    assert probe.dtypes == {torch.bfloat16, torch.float32}
    matrices = sum(p.dim() >= 2 for p in module.parameters()) - 1  # but the embedding table: fp32, as autocast has it
    widened = sum(p.dim() >= 2 for p in module.net.blocks[0].parameters()) if case == "block-twice" else 0
    assert probe.compact == [matrices - widened] * len(probe.compact)
    for name in wide:
        assert torch.equal(compact[name], wide[name]), name


def test_host_plan_counts_bf16_retained_gradients_at_two_bytes():
    from lightning_slide.engine.planner import plan_host

    a, b = torch.nn.Parameter(torch.zeros(10, 4)), torch.nn.Parameter(torch.zeros(6))
    optimizer = torch.optim.AdamW([a, b])
    plan = plan_host([[a], [b]], optimizer, retained={a, b}, landing_bytes=0, pinned=False, compact_grads={a})
    assert plan.retained_grads == 40 * 2 + 6 * 4


@pytest.mark.parametrize("schedule", ["backward", pytest.param("forward", marks=pytest.mark.slow)])
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adam", marks=pytest.mark.slow),
                                       pytest.param("sgd", marks=pytest.mark.slow)])  # fmt: skip
def test_embedding_update_in_two_parts_equals_one_update(monkeypatch, optimizer, schedule):
    # embedding.py: the rows no token touched are updated when the backward starts, the touched ones when their
    # gradients arrive ("backward", by the CPU worker, deferred to the next gather: those it reads first) or the step
    # ends ("forward": on the device, or by the worker), where the next forward takes the rows it shares with the
    # step from the device. Chunks of 10 rows, so both parts run over several chunks (the vocabulary has 101 rows),
    # and the touched rows of a chunk are updated 3 at a time. On the CPU the "device" runs the same kernel, so all
    # give the same bits.
    from lightning_slide.engine import rows
    from lightning_slide.engine.embedding import EmbeddingRows

    splits, copies = record_splits(monkeypatch), []
    find = rows.RowCopy.find
    monkeypatch.setattr(rows.RowCopy, "find", lambda self, index: copies.append(find(self, index)) or copies[-1])
    deferred, apply_landed, apply_deferred = [], rows.RowSplit.apply_landed, EmbeddingRows.apply_deferred
    sent, sent_first = threading.Event(), []  # a gather sent rows while the first part ran

    def late_rest(self, optimizer, hypers, only):  # a gather that read the rest's rows would find them stale
        deferred.append((int(only.sum()), len(only)))
        if len(deferred) % 2 == 0:
            time.sleep(0.2)
        elif only.any():  # the gather sends the rows outside the deferred ones before it waits for this part
            sent_first.append(sent.wait(timeout=5))
        apply_landed(self, optimizer, hypers, only)

    def fresh_apply_deferred(self, first):
        sent.clear()
        return apply_deferred(self, first)

    monkeypatch.setattr(rows.RowSplit, "apply_landed", late_rest)
    monkeypatch.setattr(EmbeddingRows, "apply_deferred", fresh_apply_deferred)
    send = EmbeddingRows.send_host_rows
    monkeypatch.setattr(EmbeddingRows, "send_host_rows", lambda *a: sent.set() or send(*a))
    write_back = rows.RowSplit.write_back

    def slow_write_back(self, optimizer, name, lo, values):  # the next forward comes before the host has the rows
        if lo == 0 and name == "param":
            time.sleep(0.5)
        write_back(self, optimizer, name, lo, values)

    monkeypatch.setattr(rows.RowSplit, "write_back", slow_write_back)
    module = CausalLM(tiny_config("llama"), optimizer=optimizer)

    def strategy(**knobs) -> SlideFormerStrategy:  # chunks of 10 rows, touched rows updated 3 at a time
        config = EngineConfig(chunk_numel=10 * 32, rows_pass_numel=3 * 32, split_embedding_update=True)
        return SlideFormerStrategy(num_slots=2, update_schedule=schedule, engine=replace(config, **knobs))

    on_device, _ = fit(module, strategy())
    assert len(splits) == 6  # every step
    assert all(0 < n < VOCAB for n, _ in splits)  # rows of both kinds
    device = schedule == "forward"
    assert [d for _, d in splits] == [False] + [device] * 5  # the first step creates the optimizer state
    assert len(copies) == (4 if device else 0)  # the forwards of steps 3 to 6 took rows from the device copy
    assert all(0 < int(held.sum()) < len(held) for held, _ in copies)  # and from the host
    if schedule == "backward":  # steps 1-5: the next gather's rows first, then the rest; step 6's at the end of fit
        firsts, rests = deferred[0::2], deferred[1::2]
        assert len(firsts) == 6
        assert all(0 < n < total for n, total in firsts[:5])
        assert firsts[5][0] == 0
        assert all(a + b == total for (a, total), (b, _) in zip(firsts, rests))
        assert sent_first == [True] * 5
    else:
        assert not deferred
    on_cpu, _ = fit(module, strategy(device_row_update=False))
    deferred.clear()
    undeferred, _ = fit(module, strategy(device_row_update=False, defer_touched_rows=False))
    assert not deferred
    one, _ = fit(module, strategy(split_embedding_update=False))
    assert all(torch.equal(on_cpu[k], one[k]) for k in one)
    assert all(torch.equal(on_device[k], one[k]) for k in one)
    assert all(torch.equal(undeferred[k], one[k]) for k in one)


def test_rows_sent_before_the_deferred_update_wait_for_the_bulk(monkeypatch):
    # the gather sends the rows outside the last step's touched ones before that step's deferred update
    # (embedding.py); their update is the bulk's. With all but the embedding frozen, nothing else waits for the
    # worker, and a slow bulk is still running when the next step starts
    from lightning_slide.engine import rows

    bulk = rows.RowSplit.bulk
    monkeypatch.setattr(rows.RowSplit, "bulk", lambda *a: time.sleep(0.3) or bulk(*a))
    gathers = count_deferred_gathers(monkeypatch)
    module = CausalLM(tiny_config("llama"))
    module.requires_grad_(False)
    module.model.model.embed_tokens.requires_grad_(True)
    split = EngineConfig(split_embedding_update=True)
    deferred, _ = fit(module, SlideFormerStrategy(num_slots=2, engine=split), steps=4)
    assert sum(gathers) == 3  # steps 2 to 4
    not_deferred = replace(split, defer_touched_rows=False)
    undeferred, _ = fit(module, SlideFormerStrategy(num_slots=2, engine=not_deferred), steps=4)
    assert all(torch.equal(deferred[k], undeferred[k]) for k in undeferred)


def test_touched_rows_are_not_deferred_where_they_would_hold_most_landing_buffers(monkeypatch):
    # deferred, the touched rows' gradients keep their landing buffers into the next step; with a pool of 3 buffers
    # of 10 rows, a batch's ~30 rows would hold them all (and the sender would wait for itself): updated at once
    from lightning_slide.engine import rows
    from lightning_slide.engine.transfer import Transfer

    take = Transfer.take_landing

    def take_or_fail(self, check):  # fail, rather than hang, where no buffer comes back
        start = time.monotonic()

        def bounded():
            check()
            if time.monotonic() - start > 20:
                raise RuntimeError("no landing buffer came back in 20 s")

        return take(self, bounded)

    monkeypatch.setattr(Transfer, "take_landing", take_or_fail)

    deferred, apply_landed = [], rows.RowSplit.apply_landed
    monkeypatch.setattr(rows.RowSplit, "apply_landed", lambda self, *a: deferred.append(1) or apply_landed(self, *a))
    module = CausalLM(tiny_config("llama"))
    knobs = EngineConfig(chunk_numel=10 * 32, landing_buffers=3, split_embedding_update=True)
    split, _ = fit(module, SlideFormerStrategy(num_slots=2, update_schedule="backward", engine=knobs), steps=3)
    assert not deferred
    knobs = replace(knobs, split_embedding_update=False)
    one, _ = fit(module, SlideFormerStrategy(num_slots=2, update_schedule="backward", engine=knobs), steps=3)
    assert all(torch.equal(split[k], one[k]) for k in one)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_the_touched_rows_update_on_the_device_is_in_the_memory_plan(monkeypatch, clip):
    # schedule "forward": the rows' gradient, values and both moments stay on the device from the step's end until
    # their write-back, which may overlap the next backward's peak; the activation plan keeps room for them
    from lightning_slide.engine import activations, machine

    reserved = []
    plan = activations.blocks_to_offload
    monkeypatch.setattr(machine, "device_budget", lambda device: 1 << 40)  # the planner runs; nothing offloads
    monkeypatch.setattr(activations, "blocks_to_offload", lambda saved, blocks, budget, queued: reserved.append(
        queued) or plan(saved, blocks, budget, queued))  # fmt: skip
    fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2), steps=1, gradient_clip_val=clip)
    rows = token_data()[:4].unique().numel()  # the first batch's distinct tokens
    queued = 1 << 30  # the engine's max_queued_grad_bytes
    assert reserved == [queued + (4 * rows * 32 * 4 if clip else 0)]  # AdamW, hidden size 32, fp32


@pytest.mark.parametrize("schedule", ["forward", "backward"])
def test_nonfinite_embedding_gradient_never_reaches_the_touched_rows(schedule):
    # without clipping, a NaN in the embedding's gradient alone stops training before the touched rows' update:
    # "forward", on the device, so it never reaches the host's masters nor the next forward; "backward", deferred to
    # the next gather (embedding.py)
    kept = []
    with pytest.raises(NonFiniteGradientError, match="optimizer step 3 in 'model.model.embed_tokens'"):
        fit(NaNIntoEmbedding(tiny_config("llama")), SlideFormerStrategy(num_slots=2, update_schedule=schedule,
            engine=EngineConfig(split_embedding_update=True)), steps=5, callbacks=[_KeepModule(kept)])  # fmt: skip
    assert all(bool(v.isfinite().all()) for v in kept[0].state_dict().values())


def test_embedding_without_gradient_after_its_rows_were_updated_is_an_error():
    class Detached(CausalLM):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            embeds = self.model.get_input_embeddings()(ids).detach()
            return self.model(inputs_embeds=embeds, labels=ids).loss

    strategy = SlideFormerStrategy(num_slots=2, engine=EngineConfig(split_embedding_update=True))
    with pytest.raises(RuntimeError, match="no gradient reached the embedding"):
        fit(Detached(tiny_config("llama")), strategy, steps=1)


def test_the_worker_records_its_tasks_when_asked():
    # the benchmark's per-task timeline of the CPU worker (bench_core.py, the profiled step)
    from lightning_slide.engine.worker import CpuWorker

    def nap():
        time.sleep(0.02)

    def note():
        pass

    worker = CpuWorker()
    try:
        worker.submit(nap).result()
        assert worker.timeline is None  # off unless asked for
        worker.timeline = []
        worker.submit(nap)
        worker.submit(note).result()
        (first, taken_1, start_1, end_1), (second, taken_2, start_2, end_2) = worker.timeline
        assert (first, second) == ("nap", "note")
        assert taken_1 <= start_1
        assert end_1 - start_1 >= 0.02
        assert end_1 <= taken_2 <= start_2 <= end_2
    finally:
        worker.shutdown()


@pytest.mark.parametrize("waits", [False, True])
def test_auto_split_follows_the_workers_waiting_in_the_second_step(monkeypatch, caplog, waits):
    # "auto": from the third step on, the split runs where the worker waited for the GPU at least as long as the
    # embedding's update took. On the CPU the worker never waits for a device; here it is made to look as if it did.
    from lightning_slide.engine.worker import CpuWorker

    if waits:
        run = CpuWorker._run
        monkeypatch.setattr(
            CpuWorker, "_run", lambda self, *a: setattr(self, "wait_s", self.wait_s + 1) or run(self, *a)
        )
    splits = record_splits(monkeypatch)
    with caplog.at_level("INFO", logger="lightning_slide.engine.embedding"):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2), steps=5)  # "auto", the default
    assert len(splits) == (3 if waits else 0)  # steps 3, 4 and 5
    assert ("runs the embedding's update in two parts" in caplog.text) == waits


@pytest.mark.parametrize("skip", [False, True])
def test_norm_first_nonfinite_norm_stops_or_skips(skip):
    config = tiny_config("llama")
    nan_module = _NaNAt(config)
    strategy = SlideFormerStrategy(num_slots=2, update_schedule="norm-first", on_nonfinite="skip" if skip else "raise")
    if not skip:
        with pytest.raises(NonFiniteGradientError, match="optimizer step 2 in 'the global gradient norm'"):
            fit(nan_module, strategy, steps=4, gradient_clip_val=1.0)
        return
    skip_module = _NaNAt(config, skip=True)
    skip_module.load_state_dict(nan_module.state_dict())
    ref, _ = fit(skip_module, "auto", steps=4, gradient_clip_val=1.0)
    ours, _ = fit(nan_module, strategy, steps=4, gradient_clip_val=1.0)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _OwnClipping(CausalLM):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


@pytest.mark.parametrize(
    ("kwargs", "module", "match"),
    [
        ({}, CausalLM, "needs Trainer\\(gradient_clip_val"),
        ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, CausalLM, "not by value"),
        ({"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}, CausalLM, "cannot accumulate"),
        ({"gradient_clip_val": 0.5}, _OwnClipping, "overridden configure_gradient_clipping"),
    ],
)
def test_norm_first_refuses_what_it_cannot_do(kwargs, module, match):
    with pytest.raises(ValueError, match=f"norm-first' .*{match}"):
        fit(module(tiny_config("llama")), SlideFormerStrategy(update_schedule="norm-first"), steps=1, **kwargs)


def test_auto_clips_with_norm_first_when_the_gradients_would_not_fit_ram(monkeypatch, caplog):
    # RAM for everything "norm-first" keeps, but not for the step's gradients too
    import lightning_slide.strategy as strategy_module

    plans = {}

    class Plans(L.Callback):
        def on_train_start(self, trainer, *args):
            plans[trainer.strategy.engine.schedule] = trainer.strategy.engine.host_plan()

    for schedule in ("forward", "norm-first"):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(update_schedule=schedule), steps=1,
            gradient_clip_val=0.5, callbacks=[Plans()])  # fmt: skip
    assert plans["norm-first"].added < plans["forward"].added
    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: plans["norm-first"].added)
    with caplog.at_level("INFO", logger="lightning_slide.placement"):
        _, module = fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(), steps=1, gradient_clip_val=0.5,
                        callbacks=[Plans()])  # fmt: skip
    assert "update_schedule='norm-first'" in caplog.text


def test_auto_keeps_bf16_gradients_in_bf16_only_when_fp32_ones_would_not_fit_ram(monkeypatch, caplog):
    import lightning_slide.strategy as strategy_module

    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, *args):
            engine = trainer.strategy.engine
            seen.update(plan=engine.host_plan(), schedule=engine.schedule, compact=len(engine.updates.compact))

    def run(compact="auto"):
        seen.clear()
        strategy = SlideFormerStrategy(num_slots=2, engine=EngineConfig(compact_retained_grads=compact))
        fit(StackLM(dropout=0.0), strategy, steps=1, precision="bf16-mixed", gradient_clip_val=0.5,
            callbacks=[Probe()])  # fmt: skip
        return dict(seen)

    wide = run()  # "auto", plenty of RAM: fp32 gradients
    compact = run(True)
    assert wide["compact"] == 0 < compact["compact"]
    assert compact["plan"].added < wide["plan"].added
    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: wide["plan"].added)
    assert run()["compact"] == 0
    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: wide["plan"].added - 1)
    with caplog.at_level("INFO", logger="lightning_slide.placement"):
        picked = run()
    assert (picked["schedule"], picked["compact"]) == ("forward", compact["compact"])
    assert "bf16 gradients in bf16" in caplog.text


class _ReadsGrads(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        pass


@pytest.mark.parametrize(
    ("kwargs", "strategy_kwargs", "callbacks", "splits"),
    [
        (dict(gradient_clip_val=0.05), {}, [], True),  # clipping by norm that triggers: schedule "forward"
        (dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"), {}, [], True),
        # no clipping: the rows checked for NaN/Inf on the host
        pytest.param({}, dict(update_schedule="forward"), [], True, marks=pytest.mark.slow),
        (dict(gradient_clip_val=0.05), {}, [_ReadsGrads()], False),  # a hook sees param.grad
        (dict(gradient_clip_val=0.05), dict(on_nonfinite="skip"), [], False),
        pytest.param(dict(gradient_clip_val=0.05, accumulate_grad_batches=2), {}, [], False, marks=pytest.mark.slow),
        pytest.param(dict(gradient_clip_val=0.05, accelerator="gpu"), {}, [], True, marks=pytest.mark.gpu),
    ],
)
def test_forward_schedule_updates_the_embedding_in_two_parts_exactly(
    monkeypatch, kwargs, strategy_kwargs, callbacks, splits
):
    # the rows no token touched are updated while the backward runs; the touched ones keep their gradients in a
    # buffer of their own until the global norm is known (embedding.py)
    started = record_splits(monkeypatch)
    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", **kwargs)
    strategy = streamed(num_slots=2, engine=EngineConfig(chunk_numel=10 * 32), **strategy_kwargs)
    ours, _ = fit(module, strategy, callbacks=callbacks, **kwargs)
    assert len(started) == (6 if splits else 0)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"


class _NaNIntoBlock1(CausalLM):
    """A NaN in the gradient flowing into ``layers[1]`` at optimizer step 2 (the third): its parameters' gradients and
    those below it are non-finite; the head, the norm and the blocks above are not."""

    def training_step(self, batch, batch_idx):
        hook = None
        if self.global_step == 2:

            def poison(module, args, output):
                hidden = output[0] if isinstance(output, tuple) else output
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: grad * float("nan"))

            hook = self.model.model.layers[1].register_forward_hook(poison)
        try:
            return super().training_step(batch, batch_idx)
        finally:
            if hook is not None:
                hook.remove()


def test_a_nonfinite_gradient_of_a_deferred_block_stops_before_its_update(monkeypatch):
    # found on the device as the gradients left (GradSender.check_window), not by a CPU pass over them
    from lightning_slide.engine.grads import GradSender

    checked = []
    check = GradSender.check_window
    monkeypatch.setattr(GradSender, "check_window", lambda self, *a: checked.append(check(self, *a)) or checked[-1])
    module = _NaNIntoBlock1(tiny_config("llama"))
    module.model.model.embed_tokens.requires_grad_(False)  # only the deferred blocks 0 and 1 see the NaN
    kept = []
    strategy = streamed(num_slots=2, engine=EngineConfig(deferred_updates=2))
    with pytest.raises(NonFiniteGradientError, match="optimizer step 2 in 'model.model.layers.0'") as raised:
        fit(module, strategy, steps=4, callbacks=[_KeepModule(kept)])
    assert checked
    assert all(checked)
    assert "model.lm_head" in raised.value.applied
    assert not any(".layers.0" in n or ".layers.1" in n for n in raised.value.applied)
    assert all(torch.isfinite(p).all() for p in kept[0].parameters())


@pytest.mark.parametrize(("schedule", "clip"), [("auto", None), ("forward", None), ("auto", 1.0), ("deferred", None)])
def test_a_nonfinite_step_names_what_it_applied_and_no_mixed_checkpoint_is_saved(tmp_path, caplog, schedule, clip):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    module = _NaNIntoBlock1(tiny_config("llama"))

    def strategy():
        if schedule == "deferred":  # blocks 0 and 1 updated during the next forward, checked on the device
            return SlideFormerStrategy(num_slots=2, engine=EngineConfig(deferred_updates=2))
        return SlideFormerStrategy(num_slots=2, update_schedule=schedule)

    before, _ = fit(module, strategy(), steps=2, gradient_clip_val=clip)  # the state before the failing step
    kept = []
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="crash")
    callbacks = [_KeepModule(kept), on_exception]
    with pytest.raises(NonFiniteGradientError, match="at optimizer step 2") as raised:
        fit(module, strategy(), steps=4, gradient_clip_val=clip, callbacks=callbacks, enable_checkpointing=True)
    after = {k: v.detach().float().clone() for k, v in kept[0].state_dict().items()}
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    applied = raised.value.applied
    # the error names exactly the units whose parameters took the step
    units = {name.split(" ")[0] for name in applied}
    assert {k for k in moved if not any(k.startswith(u + ".") for u in units)} == set()
    assert all(any(k.startswith(u + ".") for k in moved) for u in units)
    if applied:
        assert "had been already" in str(raised.value)
        assert not (tmp_path / "crash.ckpt").exists()  # no checkpoint of the mixed state
        assert "SlideFormer saved no checkpoint" in caplog.text
    else:
        assert "nothing of that step was applied" in str(raised.value)
        saved = torch.load(tmp_path / "crash.ckpt", weights_only=True)["state_dict"]  # the state before the step
        assert all(torch.equal(saved[k].float(), before[k]) for k in before)
    if schedule in ("auto", "deferred") and clip is None:  # updates as gradients arrive: the head and the blocks
        assert "model.lm_head" in units  # above it went
        assert "model.model.layers.3" in units
