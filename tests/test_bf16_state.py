"""Adam's moments in bf16 (``optimizer_state="bf16"``): the C kernel against its torch reference and its Triton twin,
the rounding's expectation, and training through the engine (RAM and NVMe, checkpoints) against fp32 state and plain
Lightning."""

import os
from dataclasses import astuple

import pytest
import torch

from helpers import CausalLM, fit, max_rel_error, tiny_config
from lightning_slide import SlideFormerStrategy
from lightning_slide.engine import adam_bf16
from lightning_slide.engine.adam_bf16 import AdamArgs, adam_bf16_ref


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _update_inputs(seed: int, rows: int, width: int, grad_dtype: torch.dtype, amsgrad: bool, gathered: bool):
    # a parameter, its gradient, its bf16 moments (and amsgrad's maximum), and where it lies in its whole parameter
    generator = torch.Generator().manual_seed(seed)
    p, g = (torch.randn(rows, width, generator=generator) for _ in range(2))
    m = torch.randn(rows, width, generator=generator).bfloat16()
    v, vmax = (torch.rand(rows, width, generator=generator).bfloat16() for _ in range(2))
    where = dict(rows=torch.randperm(3 * rows, generator=generator)[:rows]) if gathered else dict(index0=12345)
    return p, g.to(grad_dtype), m, v, vmax if amsgrad else None, where


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_rounds_as_its_torch_reference_bit_for_bit(decoupled, amsgrad, gathered, grad_dtype):
    # odd sizes, several threads, a gradient scale and maximize: every element the same bits as the reference
    rows, width = 4099, 37
    p, g, m, v, vmax, where = _update_inputs(7, rows, width, grad_dtype, amsgrad, gathered)
    args = AdamArgs.of(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
                       maximize=not decoupled, step=5, scale=0.37)  # fmt: skip
    ref = [t.clone() if t is not None else None for t in (p, g, m, v, vmax)]
    copy = torch.empty(rows, width, dtype=torch.bfloat16)  # the updated values in bf16, written as they are stored
    adam_bf16.step(p, g, m, v, vmax, args, 99, threads=3, copy=copy, **where)
    adam_bf16_ref(*ref, args, 99, **where)
    for got, want in zip((p, m, v, vmax), (ref[0], *ref[2:])):
        if want is not None:
            assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(copy), _bits(p.bfloat16()))
    assert not torch.equal(_bits(p), _bits(g.float()))  # the parameters moved


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("amsgrad", "gathered", "grad_dtype"), [
    (False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16),
    (True, True, torch.float32),
])  # fmt: skip
def test_the_triton_twin_gives_the_host_kernels_bits(device, amsgrad, gathered, grad_dtype):
    # on a GPU (the units kept there, rows updated there) the update is the Triton kernel's: the C kernel's bits; on
    # the CPU it runs interpreted
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1")
    from lightning_slide.kernels.adam_bf16 import adam_bf16 as twin

    p, g, m, v, vmax, where = _update_inputs(5, 301, 37, grad_dtype, amsgrad, gathered)
    args = AdamArgs.of(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=not amsgrad,
                       maximize=amsgrad, step=4, scale=0.61)  # fmt: skip
    seed = 0xCAFEF00D  # above 2**31: the kernel's argument is 64-bit, its bits are not
    host = [t.clone() if t is not None else None for t in (p, g, m, v, vmax)]
    adam_bf16.step(*host, args, seed, threads=2, **where)
    ours = [t.to(device, copy=True) if t is not None else None for t in (p, g, m, v, vmax)]
    if device == "cuda":  # the engine's own entry, which takes the twin for CUDA tensors
        adam_bf16.step(*ours, args, seed, **where)
    else:
        twin(*ours, astuple(args), seed, **where)
    for got, want in zip(ours[:1] + ours[2:], host[:1] + host[2:]):
        if want is not None:
            assert torch.equal(_bits(got.cpu()), _bits(want))
    assert not torch.equal(_bits(host[0]), _bits(p))  # the parameters moved


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_copy_may_take_the_gradients_place(amsgrad):
    # a delayed block's next weights are written where its bf16 gradient was read (delay.py): the same update, and the
    # gradient's buffer then holds the copy
    generator = torch.Generator().manual_seed(9)
    p, g = torch.randn(70_001, generator=generator), torch.randn(70_001, generator=generator).bfloat16()
    m, v, vmax = (torch.rand(70_001, generator=generator).bfloat16() for _ in range(3))
    vmax = vmax if amsgrad else None
    args = AdamArgs.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                       step=2, scale=0.8)  # fmt: skip
    apart = [t.clone() if t is not None else None for t in (p, g, m, v, vmax)]
    copy = torch.empty_like(g)
    adam_bf16.step(*apart, args, 5, threads=3, copy=copy)
    adam_bf16.step(p, g, m, v, vmax, args, 5, threads=3, copy=g)
    for got, want in zip((p, m, v, vmax, g), (*apart[:1], *apart[2:], copy)):
        if want is not None:
            assert torch.equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="into the gradient's place only for a whole bf16 gradient"):
        adam_bf16.step(p, g, m, v, None, args, 5, copy=g, rows=torch.arange(70_001))


def test_a_bf16_gradient_read_as_it_is_updates_as_its_fp32_widening():
    # the engine sends a bf16 matmul's weight gradient in bf16 where the kernel updates it: exact, as widened first
    generator = torch.Generator().manual_seed(3)
    p, g = torch.randn(300_000, generator=generator), torch.randn(300_000, generator=generator).bfloat16()
    m, v = torch.randn(300_000, generator=generator).bfloat16(), torch.rand(300_000, generator=generator).bfloat16()
    args = AdamArgs.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                       step=3, scale=0.5)  # fmt: skip
    wide = [t.clone() for t in (p, m, v)]
    adam_bf16.step(p, g, m, v, None, args, 11, threads=2)
    adam_bf16.step(wide[0], g.float(), wide[1], wide[2], None, args, 11, threads=2)
    for got, want in zip((p, m, v), wide):
        assert torch.equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="an fp32 or bf16 gradient; got torch.float16"):
        adam_bf16.step(p, g.half(), m, v, None, args, 11)


def test_an_update_of_gathered_rows_is_the_whole_update_of_those_rows():
    # the embedding's touched rows are updated gathered (rows.py): the same random bits as in the whole matrix
    generator = torch.Generator().manual_seed(0)
    p, g = (torch.randn(50, 64, generator=generator) for _ in range(2))
    m, v = torch.randn(50, 64, generator=generator).bfloat16(), torch.rand(50, 64, generator=generator).bfloat16()
    args = AdamArgs.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False,
                       step=2)  # fmt: skip
    index = torch.tensor([3, 17, 42])
    rows = [t[index].clone() for t in (p, g, m, v)]
    adam_bf16.step(*rows, None, args, 5, rows=index)
    adam_bf16.step(p, g, m, v, None, args, 5)
    for got, whole in zip((rows[0], rows[2], rows[3]), (p, m, v)):
        assert torch.equal(_bits(got), _bits(whole[index]))


def test_stochastic_rounding_keeps_the_second_moment_moving():
    # v = 0.999 v + 0.001 g^2 changes by 0.1 % a step, less than half a bf16 unit: rounded to nearest it would never
    # move from 1.0 towards g^2 = 2; rounded stochastically its mean follows fp32's
    n, steps = 1 << 16, 200
    p, g = torch.zeros(n), torch.full((n,), 2.0**0.5)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    exact = torch.ones(())
    for step in range(1, steps + 1):
        args = AdamArgs.of(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                           maximize=False, step=step)  # fmt: skip
        adam_bf16.step(p, g, m, v, None, args, seed=step)
        exact = exact * 0.999 + 0.001 * 2.0
    assert float(exact) > 1.18  # it moved ~0.18 over the steps: far more than a bf16 unit near 1 (0.0078)
    assert abs(v.float().mean() - exact) / exact < 1e-3
    nearest = torch.ones((), dtype=torch.bfloat16)
    for _ in range(steps):
        nearest = (nearest.float() * 0.999 + 0.001 * 2.0).bfloat16()
    assert float(nearest) == 1.0  # what rounding to nearest would have kept


def test_training_with_bf16_state_stays_near_fp32_state_and_keeps_bf16_moments():
    module = CausalLM(tiny_config("llama"))
    kwargs = dict(steps=8, gradient_clip_val=0.5)
    ref, _ = fit(module, "auto", **kwargs)
    fp32, _ = fit(module, SlideFormerStrategy(num_slots=2), **kwargs)
    ours, trained = fit(module, SlideFormerStrategy(num_slots=2, optimizer_state="bf16"), **kwargs)
    start = {k: v.float() for k, v in module.state_dict().items()}
    moved = max_rel_error(ref, start)[0]
    assert max_rel_error(fp32, ref)[0] < 1e-5
    err, where = max_rel_error(ours, ref)
    assert 0 < err < 0.02 * moved, f"{where}: {err:.2e} (the update: {moved:.2e})"
    states = trained.trainer.optimizers[0].state.values()
    assert {s["exp_avg"].dtype for s in states} == {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}


@pytest.mark.parametrize(("delay", "clip", "accelerator"), [
    (False, None, "cpu"), pytest.param(True, None, "cpu", marks=pytest.mark.slow), (True, 1.0, "cpu"),
    pytest.param(False, None, "gpu", marks=pytest.mark.gpu), pytest.param(True, 1.0, "gpu", marks=pytest.mark.gpu),
])  # fmt: skip
def test_bf16_gradients_reach_the_kernel_as_they_are_and_train_as_widened_bit_for_bit(
    monkeypatch, delay, clip, accelerator
):
    # a bf16 matmul's weight gradient is a bf16 number: streamed to its update, or held for it (the delayed blocks',
    # schedule "forward"'s), it stays bf16 and the kernel reads it so; the weights equal those of fp32 gradients
    from lightning_slide.engine import EngineConfig
    from lightning_slide.engine.optim import CpuOptimizer

    dtypes = []
    step = adam_bf16.step
    monkeypatch.setattr(
        adam_bf16, "step", lambda p, g, *args, **kwargs: dtypes.append(g.dtype) or step(p, g, *args, **kwargs)
    )
    module = CausalLM(tiny_config("llama"), scheduler=False)

    def run(**engine):
        strategy = SlideFormerStrategy(placement="stream", num_slots=2, optimizer_state="bf16", delayed_update=delay,
                                       delay_warmup=2, engine=EngineConfig(**engine))  # fmt: skip
        state, _ = fit(
            module, strategy, steps=6, precision="bf16-mixed", gradient_clip_val=clip, accelerator=accelerator
        )
        return state

    narrow = run()
    assert {torch.bfloat16, torch.float32} <= set(dtypes)  # the matrices' gradients in bf16, the norms' in fp32
    dtypes.clear()
    monkeypatch.setattr(CpuOptimizer, "reads_bf16_grads", lambda self, param: False)
    wide = run(compact_retained_grads=False)
    assert set(dtypes) == {torch.float32}
    assert all(torch.equal(narrow[k], wide[k]) for k in wide)


def test_bf16_state_on_nvme_trains_as_in_ram_and_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = CausalLM(tiny_config("llama"))
    ram, _ = fit(module, SlideFormerStrategy(num_slots=2, optimizer_state="bf16"), steps=8)
    (tmp_path / "nvme").mkdir()

    def nvme() -> SlideFormerStrategy:
        return SlideFormerStrategy(num_slots=2, optimizer_state="bf16", optimizer_offload="nvme",
                                   nvme_path=str(tmp_path / "nvme"))  # fmt: skip

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    disk, _ = fit(module, nvme(), steps=8, enable_checkpointing=True, callbacks=[saver])
    assert all(torch.equal(disk[k], ram[k]) for k in ram)  # the same kernel, the same random bits
    checkpoint = next((tmp_path / "ckpt").glob("*step=4.ckpt"))  # an epoch's end: 4 steps of the test data
    refs = torch.load(checkpoint / "checkpoint.pt", weights_only=True)["optimizer_states"][0]["state"]
    assert {ref["exp_avg"]["dtype"] for ref in refs.values()} == {"bfloat16"}  # half the bytes in the state files
    resumed, _ = fit(module, nvme(), steps=8, ckpt_path=str(checkpoint))
    assert all(torch.equal(resumed[k], ram[k]) for k in ram)
    resumed_in_ram, _ = fit(module, SlideFormerStrategy(num_slots=2, optimizer_state="bf16"), steps=8,
                            ckpt_path=str(checkpoint))  # fmt: skip
    assert all(torch.equal(resumed_in_ram[k], ram[k]) for k in ram)


def test_bf16_state_is_refused_for_sgd_and_without_a_compiler(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="SGD's momentum stays fp32"):
        fit(CausalLM(tiny_config("llama"), optimizer="sgd"), SlideFormerStrategy(optimizer_state="bf16"), steps=1)
    with pytest.raises(ValueError, match="optimizer_state must be 'fp32' or 'bf16'"):
        SlideFormerStrategy(optimizer_state="fp16")
    adam_bf16.library.cache_clear()
    monkeypatch.setenv("CC", os.path.join(os.sep, "nonexistent", "cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernel built before
    try:
        with pytest.raises(RuntimeError, match="could not build its C kernel"):
            SlideFormerStrategy(optimizer_state="bf16")
    finally:
        adam_bf16.library.cache_clear()
