"""The product layer: CausalLMModule, TextDataModule, LoRA, the `slide` command and its recipes."""

import csv
import glob
import json
import os
import shutil
import subprocess
import sys

import lightning as L
import pytest
import torch

from helpers import USER_ENV, global_error, max_rel_error, streamed
from lightning_slide import SlideFormerStrategy
from lightning_slide.__main__ import main as slide
from lightning_slide.data import IGNORE, TextDataModule, builtin_tokenizer, pack, tokenize
from lightning_slide.module import CausalLMModule, LoRA
from lightning_slide.monitor import SlideMonitor, dense_bf16_peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=262, max_position_embeddings=128)  # fmt: skip


def train(strategy="auto", *, precision="32-true", steps=4, lora=None, model=None, config=TINY, accelerator="cpu",
          **trainer_kwargs):  # fmt: skip
    """Fit a CausalLMModule on the built-in data; returns (fp32 state dict, the module, logged metrics)."""
    L.seed_everything(0, verbose=False)
    module = CausalLMModule(model=model, config=None if model else config, lora=lora, lr=1e-2, weight_decay=0.1,
                            warmup_steps=2)  # fmt: skip
    data = TextDataModule(seq_len=32, batch_size=4, val_fraction=0.02)
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=2)  # fmt: skip
    options.update(trainer_kwargs)
    trainer = L.Trainer(
        strategy=strategy, accelerator=accelerator, devices=1, precision=precision, max_steps=steps, **options
    )
    trainer.fit(module, data)
    state = {k: v.detach().float().clone() for k, v in module.model.state_dict().items()}
    return state, module, {k: v.item() for k, v in trainer.callback_metrics.items()}


def test_module_under_the_strategy_matches_plain_lightning_with_validation_metrics():
    ref, _, ref_metrics = train(val_check_interval=4)
    ours, _, metrics = train(SlideFormerStrategy(num_slots=2), val_check_interval=4)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
    assert {"val/loss", "val/perplexity", "val/accuracy"} <= set(metrics)
    for name in ("val/loss", "val/accuracy"):
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-5)
    assert metrics["val/perplexity"] == pytest.approx(torch.tensor(metrics["val/loss"]).exp().item(), rel=1e-6)


def test_validation_metrics_equal_full_logits_computation():
    _, module, metrics = train(steps=2, val_check_interval=2)
    data = TextDataModule(seq_len=32, batch_size=4, val_fraction=0.02)
    data.setup("fit")
    total = correct = tokens = 0.0
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i == 2:  # limit_val_batches=2
                break
            logits = module.causal_lm(**{k: batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits
            target = batch["labels"][:, 1:]
            valid = target != IGNORE
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), target, reduction="none")
            total += losses[valid].sum().item()
            correct += (logits[:, :-1].argmax(-1) == target)[valid].sum().item()
            tokens += valid.sum().item()
    assert metrics["val/loss"] == pytest.approx(total / tokens, rel=1e-4)
    assert metrics["val/accuracy"] == pytest.approx(correct / tokens, rel=1e-6)


@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.slow), 0.1])
def test_lora_fp32_matches_plain_peft_and_trains_only_adapters(dropout):
    lora = LoRA(r=4, alpha=8, dropout=dropout)
    ref, _, _ = train(lora=lora)
    ours, module, _ = train(SlideFormerStrategy(num_slots=2), lora=lora)
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable
    assert all("lora_" in n for n in trainable)
    optimizer = module.trainer.optimizers[0]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.model.parameters() if p.requires_grad
    }


@pytest.mark.slow
def test_lora_bf16_within_twice_plain_peft_bf16_error():
    lora = LoRA(r=4, alpha=8, dropout=0.1)
    ref32, _, _ = train(lora=lora)
    plain16, _, _ = train(lora=lora, precision="bf16-mixed")
    ours16, module, _ = train(SlideFormerStrategy(num_slots=2), lora=lora, precision="bf16-mixed")
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)
    # the frozen base was stored in bf16 on the host (2 bytes per parameter), the embedding kept fp32 rows ...
    base = module.causal_lm.model
    assert base.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
    assert base.embed_tokens.weight.dtype == torch.float32
    # ... and that changed nothing: bf16 compute reads exactly those values either way
    fp32_store, _, _ = train(SlideFormerStrategy(num_slots=2, frozen_in_compute_dtype=False), lora=lora,
                             precision="bf16-mixed")  # fmt: skip
    adapters = [k for k in ours16 if "lora_" in k]
    assert adapters
    assert all(torch.equal(ours16[k], fp32_store[k]) for k in adapters)


def test_model_from_a_local_directory_trains_in_train_mode(tmp_path):
    # from_pretrained returns the model in eval mode, and Lightning trains in whatever mode it finds: dropout (the
    # model's, LoRA's) would silently be off
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(tmp_path)
    in_eval = []

    class Modes(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            in_eval.extend(name for name, m in module.named_modules() if not m.training)

    _, module, metrics = train(SlideFormerStrategy(num_slots=2), model=str(tmp_path), steps=2, callbacks=[Modes()],
                               lora=LoRA(r=4, dropout=0.1))  # fmt: skip
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert type(module.causal_lm).__name__ == "LlamaForCausalLM"
    assert in_eval == []


def test_a_pretrained_model_streams_through_validation_as_plain_lightning_trains_it(tmp_path):
    # transformers 5.25 loads a model with its hub kernels on where the `kernels` package is installed; every
    # train()/eval() switch then kernelized it again, which put back the final norm's own forward and took it out of
    # the engine: the step after a validation failed
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(tmp_path)
    ref, _, _ = train(model=str(tmp_path), steps=3, val_check_interval=1)
    ours, module, _ = train(SlideFormerStrategy(num_slots=2, placement="stream"), model=str(tmp_path), steps=3,
                            val_check_interval=1)  # fmt: skip
    err, where = max_rel_error(ours, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(module.causal_lm, "use_kernels", None) == getattr(loaded, "use_kernels", None)  # on again


def test_step_normalization_weighs_every_token_of_the_accumulation_step_equally():
    # The micro-batch losses Lightning sums (each divided by the accumulation count) must add up to the mean
    # token loss of the whole step, computed here from full logits.
    seen = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append((outputs["loss"].item(), {k: v.clone() for k, v in batch.items()}))

    L.seed_everything(0, verbose=False)
    module = CausalLMModule(config=TINY, normalize="step", lr=1e-9)
    data = TextDataModule(seq_len=32, batch_size=4, val_fraction=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Capture()])  # fmt: skip
    trainer.fit(module, data)
    assert len(seen) == 3
    total = tokens = 0.0
    with torch.no_grad():
        for _, batch in seen:
            logits = module.causal_lm(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                      use_cache=False).logits  # fmt: skip
            target = batch["labels"][:, 1:]
            losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), target, reduction="none")
            total += losses[target != IGNORE].sum().item()
            tokens += (target != IGNORE).sum().item()
    assert all(b["step_tokens"].eq(tokens).all() for _, b in seen)
    assert sum(loss for loss, _ in seen) == pytest.approx(total / tokens, rel=1e-4)  # (outputs are divided by 3)


@pytest.mark.gpu
def test_module_on_cuda_bf16_uses_the_kernels_and_reports_mfu(tmp_path):
    # head dim 32: the strategy switches to attn_implementation="slide"; the loss runs the Triton kernel
    from transformers import AutoConfig, AutoModelForCausalLM

    # one set of initial weights: a model built from a config inits on the strategy's device, with its RNG
    torch.manual_seed(0)
    config = dict(TINY, hidden_size=128, intermediate_size=344, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(tmp_path)
    seen = set()

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen.add(module.causal_lm.config._attn_implementation)

    ref32, _, _ = train(model=str(tmp_path), accelerator="gpu", steps=6)
    plain16, _, _ = train(model=str(tmp_path), accelerator="gpu", precision="bf16-mixed", steps=6)
    ours16, _, metrics = train(streamed(num_slots=2), model=str(tmp_path), accelerator="gpu",
                               precision="bf16-mixed", steps=6, callbacks=[Look(), SlideMonitor()])  # fmt: skip
    assert seen == {"slide"}
    assert 0 < metrics["perf/mfu"] < 1
    assert metrics["mem/gpu_peak_gib"] > 0
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40", 181e12),
     ("Some Future GPU", None)],
)  # fmt: skip
def test_dense_bf16_peaks_by_device_name(name, peak):
    assert dense_bf16_peak(name) == peak


def test_counts_read_as_people_write_them():
    from lightning_slide.display import count_text

    assert [count_text(n) for n in (12, 793_472, 124_439_808, 8_030_261_248, 123_000_000_000)] == [
        "12", "793 K", "124 M", "8.03 B", "123 B"]  # fmt: skip


def test_the_command_shows_no_epoch_bound_no_version_and_no_flops(tmp_path, caplog):
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    from lightning_slide.display import SlideModelSummary, SlideRichProgressBar, SlideTQDMProgressBar, use_slide_display

    trainer = L.Trainer(max_steps=5, logger=CSVLogger(tmp_path), default_root_dir=tmp_path)  # a version: v_num
    use_slide_display(trainer, configured=[])
    bar, module = trainer.progress_bar_callback, CausalLMModule(config=TINY)
    bar.setup(trainer, module, "fit")
    assert type(bar) in (SlideRichProgressBar, SlideTQDMProgressBar)
    if isinstance(bar, RichProgressBar):
        assert bar._get_train_description(1) == "Epoch 1"  # Lightning's: "Epoch 1/-2" for a max_steps run
    assert "v_num" not in bar.get_metrics(trainer, module)
    with caplog.at_level("INFO"):
        SlideModelSummary().on_fit_start(trainer, module)
    assert "FLOPs" not in caplog.text
    assert "Params" in caplog.text
    mine = TQDMProgressBar(refresh_rate=5)
    trainer = L.Trainer(max_steps=5, logger=False, callbacks=[mine], default_root_dir=tmp_path)
    use_slide_display(trainer, configured=[mine])
    assert trainer.progress_bar_callback is mine  # a bar the user configured stays


def test_monitor_logs_throughput_and_memory_and_prints_a_summary(caplog):
    with caplog.at_level("INFO"):
        _, _, metrics = train(SlideFormerStrategy(num_slots=2), steps=4, accumulate_grad_batches=2,
                              callbacks=[SlideMonitor()])  # fmt: skip
    assert metrics["perf/tokens_per_s"] > 0
    assert 0 < metrics["mem/host_gib"] < 64
    assert "perf/mfu" not in metrics  # no GPU peak on the CPU
    assert "window: 2 slots for 4 blocks" in caplog.text
    assert "host memory plan: parameters (masters)" in caplog.text
    assert "placement: stream (no device budget" in caplog.text  # the plan's table


@pytest.mark.slow
def test_lora_base_stored_in_bf16_loads_in_bf16_and_trains_within_the_bound(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).bfloat16().save_pretrained(tmp_path)
    lora = LoRA(r=4, alpha=8, dropout=0.1)
    ref32, _, _ = train(lora=lora, model=str(tmp_path))  # 32-true: fp32 copies of the same bf16 values
    plain16, _, _ = train(lora=lora, model=str(tmp_path), precision="bf16-mixed")
    ours16, module, _ = train(SlideFormerStrategy(num_slots=2), lora=lora, model=str(tmp_path), precision="bf16-mixed")
    base = module.causal_lm.model
    assert base.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # loaded so: 2 bytes per parameter
    assert base.layers[0].input_layernorm.weight.dtype == torch.float32
    assert base.embed_tokens.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in module.parameters() if p.requires_grad)
    assert global_error(ours16, ref32) <= 2 * global_error(plain16, ref32)


@pytest.mark.slow
def test_full_fine_tuning_with_masters_on_nvme_loads_block_matrices_in_bf16(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).bfloat16().save_pretrained(tmp_path / "model")
    (tmp_path / "nvme").mkdir()
    loaded = {}

    class Look(L.Callback):
        def on_fit_start(self, trainer, module):
            model = module.causal_lm.model
            loaded.update(block=model.layers[0].mlp.up_proj.weight.dtype, norm=model.norm.weight.dtype,
                          embedding=model.embed_tokens.weight.dtype,
                          head=module.causal_lm.lm_head.weight.dtype)  # fmt: skip

    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path / "nvme"),
                                   nvme_masters=True)  # fmt: skip
    disk, module, _ = train(strategy, model=str(tmp_path / "model"), precision="bf16-mixed", callbacks=[Look()])
    ram, _, _ = train(SlideFormerStrategy(num_slots=2), model=str(tmp_path / "model"), precision="bf16-mixed")
    assert loaded == dict(block=torch.bfloat16, norm=torch.float32, embedding=torch.float32, head=torch.float32)
    assert all(torch.equal(disk[k], ram[k]) for k in ram)  # exact fp32 masters of the bf16 values: same training
    assert {p.dtype for p in module.parameters()} == {torch.float32}  # back in the parameters after training


def test_a_model_too_big_for_ram_is_refused_before_loading(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_slide.module as module_file

    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(tmp_path)
    monkeypatch.setattr(module_file, "available_host_bytes", lambda: 1024)

    def must_not_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", must_not_load)
    with pytest.raises(MemoryError, match=r"needs 0\.0 GiB of RAM for its weights \(fp32\), but only 0\.0 GiB"):
        CausalLMModule(model=str(tmp_path)).configure_model()
    from_config = AutoModelForCausalLM.from_config

    def only_on_meta(*args, **kwargs):  # the meta-device model (no memory) that sizes the weights is allowed
        assert torch.get_default_device().type == "meta", "weights were built"
        return from_config(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", only_on_meta)
    with pytest.raises(MemoryError, match=r"Building config= needs 0\.0 GiB of RAM"):
        CausalLMModule(config=TINY).configure_model()


def test_lora_base_from_a_bf16_config_is_built_in_bf16():
    _, module, _ = train(SlideFormerStrategy(num_slots=2), lora=LoRA(r=4), config=dict(TINY, dtype="bfloat16"),
                         precision="bf16-mixed", steps=2)  # fmt: skip
    base = module.causal_lm.model
    assert base.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # built so: a 32B base takes 64 GB, not 128
    assert base.layers[0].input_layernorm.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in module.parameters() if p.requires_grad)


# ---- data ---------------------------------------------------------------------------------------------------------


def test_packing_restarts_positions_and_never_predicts_across_documents():
    docs = [([1, 2, 3], [True] * 3), ([4, 5, 6, 7, 8], [True] * 5), ([9, 10], [False, True])]
    rows = pack(docs, seq_len=4, pad_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    # the 5-token document is longer than a row: its 5th token starts a new piece at position 0
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [1, 2, 3, 0], [0, 1, 0, 1]]
    assert rows["labels"].tolist() == [[IGNORE, 2, 3, IGNORE], [5, 6, 7, IGNORE], [IGNORE, 10, IGNORE, IGNORE]]


def test_document_longer_than_a_row_continues_as_a_new_document():
    rows = pack([(list(range(1, 7)), [True] * 6)], seq_len=4, pad_id=0)
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert rows["labels"].tolist() == [[IGNORE, 2, 3, 4], [IGNORE, 6, IGNORE, IGNORE]]


def test_chat_documents_train_only_assistant_turns():
    tokenizer = builtin_tokenizer()
    doc = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                        {"role": "assistant", "content": "ciao"}]}  # fmt: skip
    ids, trained = tokenize(doc, tokenizer)
    assert tokenizer.decode([i for i, t in zip(ids, trained) if t]) == "hello<|end|>ciao<|end|><|eos|>"
    assert tokenizer.decode(ids).startswith("<|system|>be brief<|end|><|user|>hi")


def test_jsonl_text_and_messages(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [{"text": "one two three"}] * 20 + [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    ] * 5
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    data = TextDataModule(path=str(path), seq_len=16, batch_size=2, val_fraction=0.2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "step_tokens"}
    assert batch["input_ids"].shape == (2, 16)
    assert data.val_rows is not None


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": "fine"}\n{"prompt": "no text"}\n', r"line 2: each document needs a 'text' string or a 'messages'"),
        ('{"text": "fine"}\n\n{"text": broken\n', r"line 3: not valid JSON"),
        (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"line 2: not UTF-8 \(byte 13: b'\\xe9'\)"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"content": "?"}]}\n', r"line 1: turn 1 of 'messages'"),
        ('{"text": "fine"}\n{"messages": ["just a string"]}\n', r"line 2: turn 0 of 'messages' is not a"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=rf"{path}, {match}"):
        TextDataModule(path=str(path)).setup("fit")


def test_a_validation_split_that_leaves_nothing_to_train_is_refused(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(ValueError, match=r"val_fraction=0.9 holds out 2 of the 2 documents, leaving none to train"):
        TextDataModule(path=str(path), val_fraction=0.9).setup("fit")


# ---- the command and its recipes -----------------------------------------------------------------------------------


def test_quickstart_recipe_runs_and_loss_falls(tmp_path):
    # as a user runs it: `python -m lightning_slide` in a fresh process, without the test's TRITON_INTERPRET
    recipe = os.path.join(ROOT, "recipes", "quickstart.yaml")
    command = [sys.executable, "-m", "lightning_slide", "fit", "--config", recipe, "--trainer.max_steps", "40",
               "--trainer.val_check_interval", "40", "--trainer.default_root_dir", str(tmp_path),
               "--trainer.enable_progress_bar", "false"]  # fmt: skip
    subprocess.run(command, env=USER_ENV, check=True, timeout=600)
    (metrics,) = glob.glob(str(tmp_path / "lightning_logs" / "*" / "metrics.csv"))
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses[-1] < 0.5 * losses[0]
    assert any(r.get("val/accuracy") for r in rows)


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml"))), ids=os.path.basename)
def test_every_recipe_parses_against_the_real_signatures(recipe, monkeypatch, tmp_path):
    import huggingface_hub.constants
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # hub ids are not fetched when parsing
    monkeypatch.setenv("SLIDE_NVME_PATH", str(tmp_path))  # the NVMe recipe's directory

    cli = LightningCLI(CausalLMModule, TextDataModule, run=False, args=["--config", recipe],
                       trainer_defaults={"strategy": "slideformer"})  # fmt: skip
    assert isinstance(cli.model, CausalLMModule)
    assert cli.model.model is None  # nothing loaded by parsing


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.no_such_key", "1"], "no_such_key"),
        (["--data.path", "/nonexistent/data.jsonl"], "no such file"),
        (["--model.config", "null", "--model.model", "./no/such/model"], "no such directory"),
        (["--model.lora", '{"target_modules": ["nope_proj"]}'], "nope_proj"),
        (["--model.lora", '{"dropout": 1.5}'], "LoRA dropout must be in [0, 1); got dropout=1.5"),
        (["--model.lora", '{"r": 0}'], "LoRA r must be a positive int; got r=0"),
        (["--model.betas", "[0.9, 1.5]"], "betas two values in [0, 1); got weight_decay=0.01, betas=(0.9, 1.5)"),
        (["--model.config.vocab_size", "100"], "The tokenizer has 262 tokens but the model's vocabulary has 100"),
    ],
)
def test_bad_input_is_one_clear_message_and_a_nonzero_exit(tmp_path, capsys, override, message):
    args = ["fit", "--config", os.path.join(ROOT, "recipes", "quickstart.yaml"), "--trainer.max_steps", "1",
            "--trainer.default_root_dir", str(tmp_path), *override]  # fmt: skip
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as info:
        slide(args)
    if info.type is SystemExit:
        assert info.value.code not in (0, None)
        assert message in capsys.readouterr().err
    else:
        assert message in str(info.value)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty data", "empty.jsonl holds no documents."),
        ("no blocks", "could not find the stack of transformer blocks"),
        ("no data extra", "are read with the `datasets` library: pip install 'lightning-slide[data]'."),
    ],
)
def test_a_refusal_during_fit_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch, case, message):
    # what the package refuses once fit has begun (the data, the model's shape): `slide fit: <why>`, exit status 1
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "rows.csv").write_text("text\nhello\n")
    override = {
        "empty data": ["--data.path", str(tmp_path / "empty.jsonl")],
        "no blocks": ["--model.config.num_hidden_layers", "0"],
        "no data extra": ["--data.path", str(tmp_path / "rows.csv")],
    }[case]
    if case == "no data extra":
        monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    args = ["fit", "--config", os.path.join(ROOT, "recipes", "quickstart.yaml"), "--trainer.max_steps", "1",
            "--trainer.default_root_dir", str(tmp_path / "run"), *override]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        slide(args)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (said,) = [line for line in err.splitlines() if line.startswith("slide fit: ")]
    assert message in said


def test_the_plan_of_a_cpu_run_names_the_cpu_and_no_unread_tokens(caplog):
    from helpers import CausalLM, fit, tiny_config

    with caplog.at_level("INFO", logger="lightning_slide.strategy"):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2), steps=1)
    (line,) = [x for x in caplog.text.splitlines() if "placement: stream" in x]
    assert "device (cpu)" in line
    assert "GPU" not in line
    assert "tokens per batch: None" not in line


# ---- checkpoints and export ---------------------------------------------------------------------------------------


def _fit_quickstart(root, *extra):
    """The quickstart recipe, shrunk for the interpreter, with checkpoints; returns the path of its checkpoint (one
    another ModelCheckpoint in ``extra`` wrote, else the recipe's last.ckpt)."""
    slide(["fit", "--config", os.path.join(ROOT, "recipes", "quickstart.yaml"), "--trainer.max_steps", "3",
           "--trainer.default_root_dir", str(root), "--trainer.enable_checkpointing", "true",
           "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", "3", "--data.seq_len", "32",
           "--data.batch_size", "2", *extra])  # fmt: skip
    found = glob.glob(str(root / "lightning_logs" / "*" / "checkpoints" / "*.ckpt"))
    (ckpt,) = [c for c in found if not c.endswith("last.ckpt")] or found
    return ckpt


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_fit_prints_the_export_command_that_round_trips_the_weights_quietly(tmp_path, capsys):
    import shlex

    from transformers import AutoModelForCausalLM

    ckpt = _fit_quickstart(tmp_path / "run")
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("slide export ")]
    words = shlex.split(line)
    assert words[words.index("--ckpt_path") + 1] == ckpt
    assert words[words.index("--config") + 1].endswith("config.yaml")
    slide(words[1:])
    out = words[words.index("--out") + 1]
    printed = capsys.readouterr()
    assert printed.out == f"wrote {out}\n"
    assert printed.err == ""
    exported = AutoModelForCausalLM.from_pretrained(out)
    module = CausalLMModule(config=dict(TINY, hidden_size=128, intermediate_size=344, max_position_embeddings=256))
    module.configure_model()
    module.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    ids = torch.randint(0, 262, (2, 17))
    torch.testing.assert_close(_logits(exported, ids), _logits(module.causal_lm, ids), rtol=0, atol=0)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


@pytest.mark.slow
def test_lora_adapter_export_loads_back_with_peft_and_resume_works(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(TINY, hidden_size=128, intermediate_size=344, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(tmp_path / "base")
    lora = ["--model.config", "null", "--model.model", str(tmp_path / "base"), "--model.lora.r", "4",
            "--model.lora.dropout", "0.1"]  # fmt: skip
    ckpt = _fit_quickstart(tmp_path / "run", *lora)
    # resuming loads the checkpoint with torch.load(weights_only=True) (no pickled classes in it) and continues
    resumed = _fit_quickstart(tmp_path / "resumed", *lora, "--ckpt_path", ckpt, "--trainer.max_steps", "5",
                              "--trainer.val_check_interval", "1", "--trainer.callbacks+=ModelCheckpoint",
                              "--trainer.callbacks.save_top_k=1", "--trainer.callbacks.monitor=step",
                              "--trainer.callbacks.mode=max")  # fmt: skip
    assert resumed.endswith("step=5.ckpt")
    (metrics,) = glob.glob(str(tmp_path / "resumed" / "lightning_logs" / "*" / "metrics.csv"))
    with open(metrics) as f:
        assert min(int(r["step"]) for r in csv.DictReader(f)) >= 3  # it continued from step 3
    (run_config,) = glob.glob(str(tmp_path / "run" / "lightning_logs" / "*" / "config.yaml"))  # with overrides
    slide(["export", "--config", run_config, "--ckpt_path", ckpt, "--out", str(tmp_path / "adapter")])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    module = CausalLMModule(model=str(tmp_path / "base"), lora=LoRA(r=4, dropout=0.1))
    module.configure_model()
    module.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    reloaded.eval(), module.eval()
    ids = torch.randint(0, 262, (2, 17))
    lora_b = [p for n, p in module.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the adapters were trained (B starts at zero)
    torch.testing.assert_close(_logits(reloaded, ids), _logits(module.model, ids), rtol=0, atol=0)
    # slide generate on the LoRA run: the adapted model's greedy continuation
    from lightning_slide.data import builtin_tokenizer

    capsys.readouterr()
    slide(["generate", "--config", run_config, "--ckpt_path", ckpt, "--prompt", "1 plus 1 is", "--max_new_tokens", "4"])
    tokenizer = builtin_tokenizer()
    prompt = tokenizer("1 plus 1 is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = reloaded.generate(input_ids=prompt, max_new_tokens=4, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    expected = "1 plus 1 is" + tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) + "\n"
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("stop", [5, pytest.param(12, marks=pytest.mark.slow)], ids=["mid-epoch", "next-epoch"])
def test_resume_mid_epoch_continues_exactly(tmp_path, stop):
    # 24 short documents, 23 for training, packed into 21 rows: 6 batches of 4 per epoch
    from lightning.pytorch.callbacks import ModelCheckpoint

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i:02d} says {'abcdefghij'[i % 10] * 9}."}) + "\n"
                            for i in range(24)))  # fmt: skip

    def run(steps, ckpt_path=None, root=None):
        L.seed_everything(0, verbose=False)
        module = CausalLMModule(config=TINY, lr=1e-2, warmup_steps=2)
        data = TextDataModule(path=str(path), seq_len=32, batch_size=4, val_fraction=0.04)
        saver = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1) if root else None
        trainer = L.Trainer(strategy=SlideFormerStrategy(num_slots=2), accelerator="cpu", max_steps=steps,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, enable_checkpointing=saver is not None,
                            callbacks=[saver] if saver else None)  # fmt: skip
        trainer.fit(module, data, ckpt_path=ckpt_path)
        assert len(data.train_dataloader()) == 6  # batches per epoch: step 3 is mid-epoch, step 12 in epoch 2
        return {k: v.detach().clone() for k, v in module.model.state_dict().items()}

    straight = run(stop, root=tmp_path / "ckpts")
    resumed = run(stop, ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"))
    err, where = max_rel_error(resumed, straight)
    assert err == 0, f"{where}: {err:.2e}"


@pytest.mark.parametrize("tier", ["ram", pytest.param("nvme-masters", marks=pytest.mark.slow)])
def test_generate_streams_the_checkpoints_greedy_continuation(tmp_path, capsys, tier):
    from lightning_slide.data import builtin_tokenizer

    nvme = ["--trainer.strategy.init_args.nvme_path", str(tmp_path / "nvme"),
            "--trainer.strategy.init_args.optimizer_offload", "nvme", "--trainer.strategy.init_args.nvme_masters",
            "true", "--trainer.precision", "bf16-mixed"] if tier != "ram" else []  # fmt: skip
    (tmp_path / "nvme").mkdir()
    ckpt = _fit_quickstart(tmp_path / "run", *nvme)
    assert os.path.isdir(ckpt) == (tier != "ram")  # the NVMe tier writes a directory checkpoint
    (config,) = glob.glob(str(tmp_path / "run" / "lightning_logs" / "*" / "config.yaml"))
    capsys.readouterr()
    slide(["generate", "--config", config, "--ckpt_path", ckpt, "--prompt", "3 plus 4 is", "--max_new_tokens", "6"])
    printed = capsys.readouterr().out
    # the same model, loaded by hand
    from lightning_slide.checkpoint_io import SlideCheckpointIO

    module = CausalLMModule(config=dict(TINY, hidden_size=128, intermediate_size=344, max_position_embeddings=256))
    module.configure_model()
    module.load_state_dict(SlideCheckpointIO.load_weights(ckpt)["state_dict"])
    tokenizer = builtin_tokenizer()
    ids = tokenizer("3 plus 4 is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = module.causal_lm.generate(input_ids=ids, max_new_tokens=6, do_sample=False,
                                        pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert printed == "3 plus 4 is" + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) + "\n"
    slide(["generate", "--config", config, "--ckpt_path", ckpt, "--chat", "--prompt", "What is 3 plus 4?",
           "--max_new_tokens", "4", "--temperature", "0.7", "--top_p", "0.9"])  # fmt: skip
    assert capsys.readouterr().out.endswith("\n")


def test_fit_without_a_checkpoint_says_how_to_get_one(tmp_path, capsys):
    slide(["fit", "--config", os.path.join(ROOT, "recipes", "quickstart.yaml"), "--trainer.max_steps", "1",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "[]",
           "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false", "--data.seq_len", "32",
           "--data.batch_size", "2"])  # fmt: skip
    assert "to export the model, train with --trainer.enable_checkpointing true" in capsys.readouterr().out


@pytest.mark.parametrize("args", [[], ["--help"]])
def test_slide_lists_every_command(capsys, args):
    with pytest.raises(SystemExit) as info:
        slide(args)
    assert info.value.code == (0 if args else 2)
    text = capsys.readouterr()
    shown = text.out if args else text.err
    for command in ("fit", "validate", "test", "predict", "export", "generate", "plan"):
        assert f"\n  {command} " in shown


@pytest.mark.parametrize(
    ("override", "first", "second"),
    [
        (["--trainer.max_stepz", "20"], "unknown option --trainer.max_stepz", "did you mean --trainer.max_steps"),
        # no prefix abbreviation
        (["--trainer.max_step", "2"], "unknown option --trainer.max_step", "did you mean --trainer.max_steps"),
        (["--model.lora.rr", "16"], "unknown option --model.lora.rr", "did you mean --model.lora.r"),
        ("yaml", "unknown key trainer.max_stepz", "did you mean trainer.max_steps"),
        (["--trainer.max_steps", "abc"], "trainer.max_steps: abc is not int", "--help"),
        (
            ["--trainer.strategy.init_args.num_slots", "x"],
            "trainer.strategy.num_slots: x is not int or one of 'auto'",
            "--help",
        ),
    ],
)
def test_a_mistyped_option_is_at_most_three_lines(tmp_path, capsys, override, first, second):
    recipe = os.path.join(ROOT, "recipes", "quickstart.yaml")
    if override == "yaml":
        bad = tmp_path / "bad.yaml"
        with open(recipe) as f:
            bad.write_text(f.read().replace("max_steps: 150", "max_stepz: 150"))
        recipe, override = str(bad), []
    with pytest.raises(SystemExit) as info:
        slide(["fit", "--config", recipe, *override])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3
    assert lines[0].startswith("slide fit: ")
    assert first in lines[0]
    assert second in lines[1]


def test_export_refuses_to_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    (tmp_path / "x.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit) as info:
        slide(["export", "--config", os.path.join(ROOT, "recipes", "quickstart.yaml"), "--ckpt_path",
               str(tmp_path / "x.ckpt"), "--out", str(tmp_path / "out")])  # fmt: skip
    assert info.value.code != 0
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_readme_pictures_regenerate_from_the_csvs(tmp_path):
    pytest.importorskip("matplotlib")  # the plots extra (in the test extra too)
    script = os.path.join(ROOT, "benchmarks", "plots.py")
    subprocess.run([sys.executable, script, "--until", "2026-12-01", "--out", str(tmp_path)], check=True, timeout=300)
    for name in ("throughput.png", "memory.png", "attention.png", "loss.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
            assert f"../benchmarks/results/plots/{name}" in f.read()


def test_the_loss_curves_are_drawn_from_their_csv(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results"
    results.mkdir()
    for name in ("core.csv", "attention.csv"):
        shutil.copy(os.path.join(ROOT, "benchmarks", "results", name), results / name)
    with open(results / "loss.csv", "w") as f:
        f.write("date,gpu,torch,triton,model,precision,system,step,train_loss\n")
        for system, precision in (("plain", "32-true"), ("slideformer", "bf16-mixed")):
            f.writelines(f"2026-12-02,H200,2.11,3.6,tiny,{precision},{system},{s},{4 / (s + 1)}\n" for s in (4, 9, 14))
    script = os.path.join(ROOT, "benchmarks", "plots.py")
    subprocess.run([sys.executable, script, "--results", str(results), "--out", str(tmp_path)], check=True, timeout=300)
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_notebook_executes(monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel runs as a user's would
    notebook = nbformat.read(os.path.join(ROOT, "recipes", "notebook.ipynb"), as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}
    ).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "val/accuracy" in outputs
    assert "ipywidgets" not in outputs  # with the notebook extra, the progress bar has its widgets


def test_the_command_logs_to_csv_and_to_tensorboard_when_installed(tmp_path):
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_slide.cli import default_loggers

    loggers = default_loggers(str(tmp_path))
    assert isinstance(loggers[0], CSVLogger)
    assert [type(x) for x in loggers[1:]] == (
        [TensorBoardLogger] if _TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE else []
    )
