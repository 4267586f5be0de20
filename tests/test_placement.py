"""The placement plan: the resident tier (the whole model on the device, plain training) against plain Lightning,
what streams instead, resumes across a change of placement, and batches the plan does not fit."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import CUDA, CausalLM, NaNIntoEmbedding, StackLM, fit, global_error, max_rel_error, tiny_config, token_data
from lightning_slide import NonFiniteGradientError, SlideFormerStrategy, placement
from lightning_slide.engine import EngineConfig

_real_choose_tier = placement.choose_tier

FP32_TOL = 1e-5


class _Placed(L.Callback):
    """Records, at each training batch, whether the engine streams and where the first parameter is."""

    def __init__(self):
        self.seen = set()

    def on_train_batch_start(self, trainer, module, *args):
        self.seen.add((trainer.strategy.engine is not None, next(module.parameters()).device.type))


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (lambda: CausalLM(tiny_config("llama", tied=True)), dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
        (lambda: CausalLM(tiny_config("qwen3")), dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
        (StackLM, dict(accumulate_grad_batches=2)),
    ],
    ids=["llama-tied-accumulate-clip", "qwen3-clip-value", "plain-module"],
)
def test_the_resident_tier_matches_plain_lightning(make, kwargs):
    # two param groups, a scheduler (CausalLM), clipping, accumulation, tied weights: everything on the device. The
    # module is made here, after the seed: the installed loss's rounding, amplified by Adam, depends on the init
    module = make()
    ref, _ = fit(module, "auto", **kwargs)
    strategy, placed = SlideFormerStrategy(device_memory_gib=1, install_loss=False), _Placed()
    ours, trained = fit(module, strategy, callbacks=[placed], **kwargs)
    assert strategy.tier.resident
    assert placed.seen == {(False, "cpu")}
    err, where = max_rel_error(ours, ref)
    assert err < FP32_TOL, f"{where}: {err:.2e}"
    # with the logits-free loss (the default): another summation order, amplified by Adam over the steps (1.1e-5 in
    # the clip-by-value case with transformers 5.24)
    err, where = max_rel_error(fit(module, SlideFormerStrategy(device_memory_gib=1), **kwargs)[0], ref)
    assert err < 5 * FP32_TOL, f"{where}: {err:.2e}"
    moved, _ = max_rel_error(ref, {k: v.float() for k, v in module.state_dict().items()})
    assert moved > 1e-2
    if isinstance(module, CausalLM) and module.model.config.tie_word_embeddings:
        assert trained.model.lm_head.weight is trained.model.model.embed_tokens.weight


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [
        (dict(), "no device budget"),
        (dict(device_memory_gib=0.3), "plain training would need"),  # the window fits, the whole run not
        (dict(device_memory_gib=1, placement="stream"), "placement='stream'"),
    ],
)
def test_what_does_not_fit_or_has_no_budget_streams(strategy, reason):
    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, "auto", steps=3)
    strategy, placed = SlideFormerStrategy(num_slots=2, **strategy), _Placed()
    ours, _ = fit(module, strategy, steps=3, callbacks=[placed])
    assert not strategy.tier.resident
    assert reason in strategy.tier.reason
    assert placed.seen == {(True, "cpu")}
    err, where = max_rel_error(ours, ref)
    assert err < FP32_TOL, f"{where}: {err:.2e}"


@pytest.mark.parametrize("first", ["stream", "auto"])
def test_a_resume_that_changes_the_placement_continues_exactly(tmp_path, first):
    # the checkpoint of a streamed run resumes on the device, and the other way round: one optimizer state format
    def strategy(placement):
        return SlideFormerStrategy(num_slots=2, placement=placement, device_memory_gib=1)

    module = CausalLM(tiny_config("llama", tied=True))
    kwargs = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)
    straight, _ = fit(module, "auto", steps=4, **kwargs)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    fit(module, strategy(first), steps=2, callbacks=[ckpt], enable_checkpointing=True, **kwargs)
    then = "auto" if first == "stream" else "stream"
    placed = _Placed()
    resumed, _ = fit(module, strategy(then), steps=4, ckpt_path=str(next(tmp_path.glob("*.ckpt"))),
                     callbacks=[placed], **kwargs)  # fmt: skip
    assert placed.seen == {(then == "stream", "cpu")}
    err, where = max_rel_error(resumed, straight)
    assert err < FP32_TOL, f"{where}: {err:.2e}"


def test_the_first_batch_fetched_ahead_leaves_the_shuffled_order_alone():
    # no tokens_per_batch: the plan reads the first batch of a shuffling loader; the run must draw the same batches
    module = StackLM()

    def run(strategy):
        trained = StackLM()
        trained.load_state_dict(module.state_dict())
        L.seed_everything(3, verbose=False)
        options = dict(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, **options)
        trainer.fit(trained, DataLoader(TensorDataset(token_data(32)), batch_size=4, shuffle=True))
        return trained.state_dict()

    strategy = SlideFormerStrategy(device_memory_gib=1)
    ours, ref = run(strategy), run("auto")
    assert strategy.tier.resident
    assert strategy.tier.tokens == 4 * 12  # a batch of 4 rows of 12 tokens
    err, where = max_rel_error(ours, ref)
    assert err < FP32_TOL, f"{where}: {err:.2e}"


def test_a_batch_with_more_tokens_than_the_plan_fits_is_refused_before_it_runs():
    module = StackLM()
    probe = SlideFormerStrategy(device_memory_gib=1, tokens_per_batch=48)
    fit(module, probe, steps=1)
    # need(t) = fixed + t * per_token; the 1 GiB budget fits (0.95 GiB - fixed) / per_token tokens
    per_token = (0.95 * 2**30 - probe.tier.need) / (probe.tier.max_tokens - 48)
    fixed = probe.tier.need - 48 * per_token
    strategy = SlideFormerStrategy(device_memory_gib=(fixed + 60 * per_token) / 0.95 / 2**30, tokens_per_batch=48)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"This batch has 96 tokens, but the placement plan fits at most 6\d per"):
        fit(module, strategy, steps=2, batch_size=8)
    assert strategy.tier.resident
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_offloaded_block_inputs_are_planned_at_setup_and_a_larger_batch_is_refused():
    # the plan counts the offloaded inputs in host memory before anything is pinned; the first forward checks them
    module = CausalLM(tiny_config("llama"))

    def strategy(tokens):
        return SlideFormerStrategy(num_slots=2, placement="stream", offload_activations=True, device_memory_gib=1,
                                   tokens_per_batch=tokens)  # fmt: skip

    ref, _ = fit(module, "auto", steps=2)
    planned = strategy(48)  # batches of 4 x 12 tokens
    ours, _ = fit(module, planned, steps=2)
    assert planned.plan.offloaded_blocks == 4
    assert planned.plan.host.activations == 4 * 48 * 32 * 4  # 4 blocks' fp32 inputs, hidden size 32
    err, where = max_rel_error(ours, ref)
    assert err < FP32_TOL, f"{where}: {err:.2e}"
    with pytest.raises(ValueError, match=r"inputs take 6,144 bytes, but the placement plan counted 3,072"):
        fit(module, strategy(24), steps=1)


@pytest.fixture
def gpu_tier(monkeypatch):
    """The strategy for the GPU tier on the CPU: a budget where the whole model "does not fit" (the tier choice is
    forced) but the units outside the blocks do, with little device memory held for gradients on their way."""
    monkeypatch.setattr(placement, "choose_tier", lambda *args: placement.Tier(False, "the whole model does not fit"))

    def strategy(**kwargs):
        config = EngineConfig(max_queued_grad_bytes=1 << 20)
        return SlideFormerStrategy(num_slots=2, device_memory_gib=2, engine=config, **kwargs)

    return strategy


def _resident(strategy):
    return [u.name for u in strategy.plan.units if u.weights == "gpu"]


@pytest.mark.parametrize(
    ("make", "kwargs"),
    [
        (lambda: CausalLM(tiny_config("llama", tied=True)), dict(accumulate_grad_batches=2, gradient_clip_val=0.05)),
        (lambda: CausalLM(tiny_config("qwen3")), dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
        (lambda: CausalLM(tiny_config("llama")), dict(accumulate_grad_batches=2)),  # schedule "backward"
        (StackLM, dict(gradient_clip_val=0.05)),
    ],
    ids=["llama-tied-accumulate-clip", "qwen3-clip-value", "llama-accumulate", "plain-module-clip"],
)
def test_the_gpu_tier_keeps_what_fits_on_the_device_and_matches_plain_lightning(gpu_tier, make, kwargs):
    # the embedding, the head, the final norm and all blocks but the last on the device (the blocks recomputing in
    # backward; the plain module's dropout replayed), stepped by the user's optimizer there; the last block streamed:
    # clipping (by norm over both, or by value), accumulation, two param groups and a scheduler
    module = make()
    ref, _ = fit(module, "auto", **kwargs)
    strategy = gpu_tier(install_loss=False)
    ours, trained = fit(module, strategy, **kwargs)
    stack = "model.model.layers" if isinstance(module, CausalLM) else "net.blocks"
    blocks = [f"{stack}.{i}" for i in range(len(module.get_submodule(stack)))]
    outside = {"model.model.embed_tokens", "model.model.norm", "model.lm_head", "net.embed", "net.norm", "net.head"}
    assert set(_resident(strategy)) == (outside & {n for n, _ in module.named_modules()}) | set(blocks[:-1])
    assert [u.name for u in strategy.plan.units if u.weights == "stream"] == blocks[-1:]
    err, where = max_rel_error(ours, ref)
    assert err < FP32_TOL, f"{where}: {err:.2e}"
    moved, _ = max_rel_error(ref, {k: v.float() for k, v in module.state_dict().items()})
    assert moved > 1e-2
    assert all(p.device.type == "cpu" and p.grad is None for p in trained.parameters())  # handed back
    err, where = max_rel_error(fit(module, gpu_tier(), **kwargs)[0], ref)  # the logits-free loss: see above
    assert err < 5 * FP32_TOL, f"{where}: {err:.2e}"


def test_units_kept_on_the_device_spare_a_short_host_the_norm_first_fallback(gpu_tier, monkeypatch):
    # RAM too short for "forward" with every unit streamed, enough once the device keeps units: "forward" with the tier
    # rather than "norm-first"; and only if the kept units' optimizer state, which Lightning's teardown brings to the
    # host after fit, fits there too
    import lightning_slide.strategy as strategy_module

    def strategy(**kwargs):
        config = EngineConfig(max_queued_grad_bytes=1 << 20, chunk_numel=1024)  # landing buffers as small as the model
        return SlideFormerStrategy(num_slots=2, device_memory_gib=2, engine=config, **kwargs)

    module, kwargs = CausalLM(tiny_config("llama")), dict(gradient_clip_val=0.05)
    planned = {}
    for name, options in [("streamed", dict(placement="stream")), ("norm-first", dict(update_schedule="norm-first"))]:
        planned[name] = strategy(**options)
        fit(module, planned[name], steps=1, **kwargs)
    streamed, norm_first = planned["streamed"].plan.host.added, planned["norm-first"].plan.host.added
    every_state = 8 * sum(p.numel() for p in module.parameters())  # AdamW's fp32 moments, all on the host after fit
    assert every_state < norm_first < streamed

    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: norm_first)
    ours = strategy()
    trained, _ = fit(module, ours, **kwargs)
    assert ours.plan.schedule == "forward"
    assert _resident(ours)
    assert ours.plan.host.added <= norm_first
    err, where = max_rel_error(trained, fit(module, "auto", **kwargs)[0])
    assert err < FP32_TOL, f"{where}: {err:.2e}"

    # room for training with the tier, not for the state after fit (nor for "norm-first"): refused at setup
    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: every_state - 1)
    with pytest.raises(MemoryError, match="more host memory.* after fit Lightning's teardown brings their optimizer"):
        fit(module, strategy(), steps=1, **kwargs)


@pytest.mark.parametrize(("first", "then"), [("gpu-tier", "stream"), ("stream", "gpu-tier"), ("gpu-tier", "whole")])
def test_a_resume_into_or_out_of_the_gpu_tier_continues_exactly(tmp_path, gpu_tier, monkeypatch, first, then):
    # one optimizer state format: a unit's state moves between the device, the host and back with its unit
    def strategy(kind):
        if kind == "whole":
            monkeypatch.setattr(placement, "choose_tier", _real_choose_tier)
            return SlideFormerStrategy(device_memory_gib=2)
        return gpu_tier(placement="stream" if kind == "stream" else "auto")

    module = CausalLM(tiny_config("llama", tied=True))
    kwargs = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)
    straight, _ = fit(module, "auto", steps=4, **kwargs)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    fit(module, strategy(first), steps=2, callbacks=[ckpt], enable_checkpointing=True, **kwargs)
    resumed, _ = fit(module, strategy(then), steps=4, ckpt_path=str(next(tmp_path.glob("*.ckpt"))), **kwargs)
    err, where = max_rel_error(resumed, straight)
    assert err < FP32_TOL, f"{where}: {err:.2e}"


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_units_kept_on_the_device_take_bf16_moments_too_and_step_as_streamed(gpu_tier, tmp_path, accelerator):
    # optimizer_state="bf16" covers the units the device keeps: bf16 moments there, updated with the host kernel's
    # arithmetic and random bits (on a GPU its Triton twin), so the run steps as the streamed one and resumes exactly;
    # the plan counts their state at 2 bytes
    module = CausalLM(tiny_config("llama"))
    kwargs = dict(steps=6, gradient_clip_val=0.05, accelerator=accelerator)
    streamed, _ = fit(module, gpu_tier(placement="stream", optimizer_state="bf16"), **kwargs)
    fp32, _ = fit(module, gpu_tier(), **kwargs)
    strategy = gpu_tier(optimizer_state="bf16")
    planned = []  # the kept units' state as the plan counts it (Lightning's teardown brings it to the host after fit)
    count = L.Callback()
    count.on_train_start = lambda trainer, _: planned.append(placement._resident_state_bytes(trainer.strategy.engine))
    ours, trained = fit(module, strategy, callbacks=[count], **kwargs)
    kept = {p for n, p in trained.named_parameters() if not n.startswith("model.model.layers.1.")}
    assert _resident(strategy)
    assert len(kept) < len(list(trained.parameters()))
    state = trained.trainer.optimizers[0].state
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in kept)
    far = max_rel_error(fp32, streamed)[0]  # what the moments' dtype changes
    err, where = max_rel_error(ours, streamed)
    assert err < 0.1 * far, f"{where}: {err:.2e} against {far:.2e}"
    assert planned == [4 * sum(p.numel() for p in kept)]  # two bf16 moments
    if accelerator == "gpu":
        return  # (the GPU's backward need not repeat bit for bit)

    # saved at the end of the first epoch (4 batches): the resumed run sees the same data
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=4)
    fit(module, gpu_tier(optimizer_state="bf16"), callbacks=[ckpt], enable_checkpointing=True, **{**kwargs, "steps": 4})
    resumed, _ = fit(module, gpu_tier(optimizer_state="bf16"), ckpt_path=str(next(tmp_path.glob("*.ckpt"))), **kwargs)
    assert all(torch.equal(resumed[k], ours[k]) for k in ours)


def test_a_nonfinite_gradient_on_the_device_stops_before_any_update(gpu_tier):
    module = NaNIntoEmbedding(tiny_config("llama"))
    with pytest.raises(NonFiniteGradientError, match="optimizer step 3 in 'model.model.embed_tokens.weight'"):
        fit(module, gpu_tier(update_schedule="forward"), steps=5)
    # with clipping and on_nonfinite="skip", the step is skipped on the device too: nothing non-finite is applied
    kwargs = dict(gradient_clip_val=0.05)
    skipped, _ = fit(module, gpu_tier(on_nonfinite="skip"), steps=5, **kwargs)
    assert all(bool(v.isfinite().all()) for v in skipped.values())


def test_placement_arguments_are_checked():
    for kwargs, match in [
        (dict(placement="gpu"), "placement must be one of"),
        (dict(device_memory_gib=0), "device_memory_gib must be a number > 0"),
        (dict(tokens_per_batch=0), "tokens_per_batch must be a positive int"),
    ]:
        with pytest.raises(ValueError, match=match):
            SlideFormerStrategy(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("install_loss", [True, False])
def test_on_cuda_the_resident_plan_bounds_the_peak_and_bf16_is_within_twice_plain_error(install_loss):
    # the installed loss builds no logits; without it Hugging Face's loss builds them (both counted by the plan)
    config = tiny_config("llama", hidden_size=1024, intermediate_size=2816, num_attention_heads=8, vocab_size=32000,
                         max_position_embeddings=512)  # fmt: skip
    module = CausalLM(config)
    data = torch.randint(0, 32000, (32, 512), generator=torch.Generator().manual_seed(0))
    kwargs = dict(accelerator="gpu", data=data, steps=4, batch_size=8)
    ref32, _ = fit(module, "auto", **kwargs)
    plain16, _ = fit(module, "auto", precision="bf16-mixed", **kwargs)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    strategy, placed = SlideFormerStrategy(install_loss=install_loss), _Placed()
    ours16, _ = fit(module, strategy, precision="bf16-mixed", callbacks=[placed], **kwargs)
    peak = torch.cuda.max_memory_allocated() - base
    assert strategy.tier.resident
    assert placed.seen == {(False, "cuda")}
    planned = strategy.tier.need
    assert planned / 2 <= peak <= planned, f"measured {peak / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB"
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_cuda_the_gpu_tier_is_within_twice_plain_bf16_error_and_the_plan_bounds_the_peak(monkeypatch):
    # the whole model "does not fit" (forced): the last block streams, the rest stays on the GPU
    monkeypatch.setattr(placement, "choose_tier", lambda *args: placement.Tier(False, "the whole model does not fit"))
    config = tiny_config("llama", hidden_size=1024, intermediate_size=2816, num_attention_heads=8, vocab_size=32000,
                         max_position_embeddings=512)  # fmt: skip
    module = CausalLM(config)
    data = torch.randint(0, 32000, (32, 512), generator=torch.Generator().manual_seed(0))
    kwargs = dict(accelerator="gpu", data=data, steps=4, batch_size=8, gradient_clip_val=1.0)
    ref32, _ = fit(module, "auto", **kwargs)
    plain16, _ = fit(module, "auto", precision="bf16-mixed", **kwargs)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    strategy = SlideFormerStrategy(num_slots=2)
    ours16, _ = fit(module, strategy, precision="bf16-mixed", **kwargs)
    peak = torch.cuda.max_memory_allocated() - base
    blocks = [f"model.model.layers.{i}" for i in range(4)]
    resident = {"model.model.embed_tokens", "model.model.norm", "model.lm_head", *blocks[:-1]}
    assert set(_resident(strategy)) == resident
    planned = strategy.plan.device_bytes
    assert peak <= planned, f"measured {peak / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB"
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)
