"""The one-step-delayed update (``delayed_update=True``, ``engine/delay.py``): exact while the warmup lasts, the
delayed rule written by hand in plain PyTorch after it, checkpoints that resume it exactly, and what is refused."""

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, TensorDataset

from helpers import CausalLM, fit, global_error, tiny_config, token_data
from lightning_slide import SlideFormerStrategy
from lightning_slide.engine import EngineConfig


def delayed(blocks: int | str = "auto", warmup: int = 2, **kwargs) -> SlideFormerStrategy:
    return SlideFormerStrategy(placement="stream", num_slots=2, delayed_update=True, delay_warmup=warmup,
                               engine=EngineConfig(delayed_blocks=blocks), **kwargs)  # fmt: skip


def reference(module: CausalLM, *, steps: int, blocks: int, warmup: int, clip: float | None = None,
              accumulate: int = 1, bf16: bool = False) -> dict:  # fmt: skip
    """The delayed rule in plain PyTorch: the first ``blocks`` layers compute step t with their weights of before step
    t-1's update (from step ``warmup`` + 1 on), every weight is updated with the gradient so computed (``bf16``: under
    bf16 autocast, as Lightning's bf16-mixed)."""
    torch.manual_seed(0)
    model = type(module)(module.model.config, scheduler=False)
    model.model.load_state_dict(module.model.state_dict())
    optimizer = model.configure_optimizers()
    params = dict(model.named_parameters())
    late = {n for n in params for i in range(blocks) if n.startswith(f"model.model.layers.{i}.")}
    held: dict[str, torch.Tensor] = {}  # the late layers' weights of before the last update
    batches = itertools.cycle(list(DataLoader(TensorDataset(token_data()), batch_size=4)))
    for step in range(steps):
        weights = {n: held[n] if step > warmup and n in late else p for n, p in params.items()}
        for _ in range(accumulate):
            (ids,) = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = functional_call(model, weights, ((ids,), 0))
            grads = torch.autograd.grad(loss / accumulate, list(weights.values()))
            for p, g in zip(params.values(), grads):
                p.grad = g if p.grad is None else p.grad + g
        if clip is not None:
            nn.utils.clip_grad_norm_(list(params.values()), clip)
        held = {n: params[n].detach().clone().requires_grad_() for n in late}
        optimizer.step()
        optimizer.zero_grad()
    return {f"model.{k}": v.detach().clone() for k, v in model.model.state_dict().items()}


def relative(a: dict, b: dict) -> float:
    return global_error(a, b) / global_error(b, {k: torch.zeros_like(v) for k, v in b.items()})


class Stepping(CausalLM):
    def forward(self, batch, batch_idx):  # what functional_call runs in reference()
        return self.training_step(batch, batch_idx)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_warmup_as_long_as_training_is_the_exact_schedule_bit_for_bit(clip):
    module = CausalLM(tiny_config("llama"), scheduler=False)
    exact, _ = fit(module, SlideFormerStrategy(placement="stream", num_slots=2), steps=5, gradient_clip_val=clip)
    warm, _ = fit(module, delayed(warmup=5), steps=5, gradient_clip_val=clip)
    assert all(torch.equal(warm[k], exact[k]) for k in exact)


@pytest.mark.parametrize(("blocks", "clip", "accumulate"), [(4, None, 1), (2, None, 1), (4, 1e-2, 1), (2, 1e-2, 1),
                                                           (3, None, 2)])  # fmt: skip
def test_delayed_blocks_follow_the_delayed_rule_written_by_hand(blocks, clip, accumulate):
    module = Stepping(tiny_config("llama"), scheduler=False)
    got, _ = fit(module, delayed(blocks, warmup=2), steps=7, gradient_clip_val=clip,
                 accumulate_grad_batches=accumulate)  # fmt: skip
    want = reference(module, steps=7, blocks=blocks, warmup=2, clip=clip, accumulate=accumulate)
    # all the weights as one vector (a tensor alone can be near zero); plain Lightning's fp32 run differs from the
    # engine's exact one by ~2e-8 here, in the order of its float sums
    assert relative(got, want) < 1e-6
    exact = reference(module, steps=7, blocks=0, warmup=2, clip=clip, accumulate=accumulate)
    assert relative(got, exact) > 1e-4  # the delay changed the result: the check above can fail


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_delayed_blocks_in_bf16_follow_the_rule_as_closely_as_plain_bf16(accelerator):
    # the copies hold the bf16 matrices the device computes with: uploaded as they are
    import lightning as L

    dtypes = set()

    class Copies(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            dtypes.update(c.dtype for c in trainer.strategy.engine.delay.live.values())

    module = Stepping(tiny_config("llama"), scheduler=False)
    got, _ = fit(module, delayed(3, warmup=2), steps=7, precision="bf16-mixed", accelerator=accelerator,
                 gradient_clip_val=1.0, callbacks=[Copies()])  # fmt: skip
    assert dtypes == {torch.bfloat16, torch.float32}  # the norms' weights stay fp32, as autocast keeps them
    fp32 = reference(module, steps=7, blocks=3, warmup=2, clip=1.0)
    plain_bf16 = reference(module, steps=7, blocks=3, warmup=2, clip=1.0, bf16=True)
    assert global_error(got, fp32) <= 2 * global_error(plain_bf16, fp32)
    exact = reference(module, steps=7, blocks=0, warmup=2, clip=1.0)
    assert global_error(got, fp32) < 0.75 * global_error(got, exact)  # nearer the delayed rule than the exact one


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_bf16_kernel_writes_the_next_weights_as_it_updates(clip):
    # optimizer_state="bf16": the delayed blocks' update writes their next weights into the spare copies in the same
    # pass; once it has run, they are the masters rounded as torch rounds them
    import lightning as L

    checked = []

    class Spare(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            delay = engine.delay
            engine.sender.drain()  # the delayed updates reach the worker from the sender after a write-back
            engine.worker.drain()
            if delay.filled and trainer.global_step > delay.warmup:
                checked.append(all(torch.equal(c, p.data.to(c.dtype)) for p, c in delay.spare.items()))

    module = Stepping(tiny_config("llama"), scheduler=False)
    fit(module, delayed(3, warmup=2, optimizer_state="bf16"), steps=7, precision="bf16-mixed", gradient_clip_val=clip,
        callbacks=[Spare()])  # fmt: skip
    assert checked == [True] * 5  # steps 2-6, the delayed ones


@pytest.mark.parametrize(("clip", "accelerator"), [
    (None, "cpu"), (1.0, "cpu"), pytest.param(1.0, "gpu", marks=pytest.mark.gpu),
])  # fmt: skip
def test_bf16_gradients_of_delayed_blocks_wait_in_their_copies_and_train_as_in_buffers_of_their_own(
    monkeypatch, clip, accelerator
):
    # optimizer_state="bf16" under bf16-mixed holds the matrices' gradients in bf16: a delayed block's lands in the
    # live copy its step computed with, and the update writes the next weights over it (delay.py); the same training,
    # bit for bit, as gradients held apart, and one buffer per parameter less in the plan
    import lightning as L

    from lightning_slide.engine import engine as engine_module

    lent, to_come = [], []

    class Lent(L.Callback):
        def on_train_start(self, trainer, *args):  # what the first step will still allocate: every retained buffer
            engine = trainer.strategy.engine
            plan = engine.host_plan()
            to_come.append(engine._host_to_come() == plan.optimizer_state + plan.retained_grads > plan.optimizer_state)

        def on_train_batch_end(self, trainer, *args):
            engine = trainer.strategy.engine
            live, host = engine.delay.live, engine.updates.host
            lent.append([n for n, p in trainer.lightning_module.named_parameters() if p in live and host[p] is live[p]])

    def run():
        strategy = SlideFormerStrategy(placement="stream", num_slots=2, delayed_update=True, delay_warmup=2,
                                       optimizer_state="bf16", engine=EngineConfig(delayed_blocks=1))  # fmt: skip
        state, _ = fit(module, strategy, steps=6, precision="bf16-mixed", gradient_clip_val=clip, callbacks=[Lent()],
                       accelerator=accelerator)  # fmt: skip
        return state, strategy.plan.host.retained_grads

    module = Stepping(tiny_config("llama"), scheduler=False)
    in_copies, retained = run()
    matrices = [n for n, p in module.named_parameters() if n.startswith("model.model.layers.0.") and p.dim() == 2]
    assert len(matrices) == 7
    assert lent == [matrices] * 6  # block 0's matrices, every step (its norms' fp32 gradients apart)
    assert to_come == [True]
    lent.clear()
    made = engine_module.retention  # the same retention, none of it in the copies
    monkeypatch.setattr(engine_module, "retention", lambda *a, **k: replace(made(*a, **k), in_copies=frozenset()))
    apart, retained_apart = run()
    assert lent == [[]] * 6
    assert all(torch.equal(in_copies[k], apart[k]) for k in apart)
    block = dict(module.named_parameters())
    assert retained_apart - retained == sum(2 * block[n].numel() for n in matrices)


def test_the_embeddings_write_back_reaches_the_worker_before_the_delayed_updates(monkeypatch):
    # schedule "forward" updates the touched embedding rows on the device and writes them back through landing
    # buffers that only the worker's write-back tasks return; queued behind the delayed updates, the write-back held
    # the next backward's start (which waits for it) until those had all run
    from lightning_slide.engine.worker import CpuWorker

    submitted = []
    submit = CpuWorker.submit

    def spy(self, fn, *args, after=None):
        name = getattr(fn, "__name__", "")
        submitted.append(args[0] if name == "_update" else name)  # an update: its unit's name
        return submit(self, fn, *args, after=after)

    monkeypatch.setattr(CpuWorker, "submit", spy)
    fit(CausalLM(tiny_config("llama"), scheduler=False), delayed(4, warmup=2), steps=6, gradient_clip_val=1.0)
    delayed_steps = submitted[submitted.index("_copy") :]  # from the warmup's end, when the copies are taken
    # from one step's bulk (as its backward starts) to the next: the step's exact updates, its write-back, its
    # delayed updates (the blocks'), the next forward
    steps = "|".join(str(name) for name in delayed_steps).split("bulk")[1:]
    assert len(steps) == 4  # steps 2-5, the delayed ones
    for step in steps:
        before, write_back, after = step.partition("_write_back_rows")
        assert write_back
        assert "layers" not in before  # no delayed update ahead of it
        assert "layers" in after


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [None, 1e-2])
def test_on_cuda_delayed_blocks_follow_the_delayed_rule(clip):
    module = Stepping(tiny_config("llama"), scheduler=False)
    got, _ = fit(module, delayed(2, warmup=2), steps=7, accelerator="gpu", gradient_clip_val=clip)
    assert relative(got, reference(module, steps=7, blocks=2, warmup=2, clip=clip)) < 1e-5
    assert relative(got, reference(module, steps=7, blocks=0, warmup=2, clip=clip)) > 1e-4


@pytest.mark.parametrize(("precision", "state"), [("32-true", "fp32"), ("bf16-mixed", "bf16")])
def test_a_checkpoint_holds_the_delayed_weights_and_resumes_exactly(tmp_path, precision, state):
    # bf16 moments under bf16-mixed: the matrices' gradients wait in the copies (delay.py), the resume too
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = CausalLM(tiny_config("llama"), scheduler=False)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    kwargs = dict(steps=8, precision=precision, gradient_clip_val=1.0)
    whole, _ = fit(module, delayed(2, optimizer_state=state), enable_checkpointing=True, callbacks=[saver], **kwargs)
    checkpoint = next(tmp_path.glob("*step=4.ckpt"))
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["state"]
    assert sum("delayed_weight" in s for s in saved.values()) == 2 * 9  # two blocks of nine trained tensors
    resumed, _ = fit(module, delayed(2, optimizer_state=state), ckpt_path=str(checkpoint), **kwargs)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    # a run that delays no block resumes from it too (the copies are dropped), as does plain Lightning
    fit(module, SlideFormerStrategy(placement="stream", optimizer_state=state), ckpt_path=str(checkpoint), **kwargs)
    fit(module, "auto", ckpt_path=str(checkpoint), **kwargs)


def test_the_plan_counts_the_copies_and_names_the_delayed_blocks():
    import lightning as L

    module = CausalLM(tiny_config("llama", layers=4), scheduler=False)
    strategy = delayed(3)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(token_data()), batch_size=4))
    plan = strategy.plan
    block = sum(p.numel() for p in module.model.model.layers[0].parameters())
    assert plan.delayed_blocks == 3
    assert plan.to_json()["delayed_blocks"] == 3
    assert plan.host.delayed_weights == 2 * 3 * block * 4  # two sets; fp32 training: fp32 copies
    assert "blocks updated a step late: 3" in plan.table()


def test_what_cannot_be_delayed_is_refused_before_training(tmp_path):
    module = CausalLM(tiny_config("llama"))
    with pytest.raises(ValueError, match="delay_warmup must be an int >= 1"):
        SlideFormerStrategy(delayed_update=True, delay_warmup=0)
    with pytest.raises(ValueError, match="delayed_update must be True or False"):
        SlideFormerStrategy(delayed_update="yes")
    with pytest.raises(ValueError, match="'norm-first' was chosen to keep no gradient"):
        fit(module, delayed(update_schedule="norm-first"), steps=1, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="asks to delay more blocks than the 4"):
        fit(module, delayed(5), steps=1)
    with pytest.raises(ValueError, match="EngineConfig\\(delayed_blocks=...\\) must be 'auto' or an int"):
        EngineConfig(delayed_blocks=-1)
