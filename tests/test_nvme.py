"""The NVMe tier: Adam's moments in real files, the same training as in RAM, exact resume, and clear errors."""

import os
import re

import lightning as L
import pytest
import torch

from helpers import CausalLM, fit, max_rel_error, tiny_config
from lightning_slide import SlideFormerStrategy
from lightning_slide.checkpoint_io import CheckpointError, SlideCheckpointIO
from lightning_slide.engine import EngineConfig
from lightning_slide.engine.nvme import NvmeStateError


@pytest.mark.parametrize(("clip", "accumulate", "small_blocks"), [
    (None, 1, False), (0.05, 1, False), pytest.param(None, 2, False, marks=pytest.mark.slow),
    pytest.param(None, 1, True, marks=pytest.mark.slow), (0.05, 1, True)])  # fmt: skip
def test_nvme_trains_exactly_like_ram_and_plain(tmp_path, monkeypatch, clip, accumulate, small_blocks):
    from lightning_slide.engine import nvme

    if small_blocks:  # every parameter of more than one page unit of rows in several blocks, as a large one would be
        monkeypatch.setattr(nvme, "rows_per_block", lambda p, n: min(nvme._rows(p), nvme._rows_per_page_unit(p)))
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            trainer.strategy.engine.wait()  # no update in flight
            store = trainer.strategy.engine.optimizer.store
            seen["dir"] = store.dir
            seen["modes"] = {oct(os.stat(p).st_mode & 0o777) for p in [*store.paths, store.dir]}
            seen["resident"] = sum(len(s) for s in trainer.optimizers[0].state.values())
            seen["planned"] = trainer.strategy.engine.host_plan().disk
            seen["files"] = sum(os.path.getsize(p) for p in store.paths)
            seen["blocks"] = max(len(r.crcs) for regions in store.regions.values() for r in regions.values())

    module = CausalLM(tiny_config("llama", tied=True))
    kwargs = dict(gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    ref, _ = fit(module, "auto", **kwargs)
    ram, _ = fit(module, SlideFormerStrategy(num_slots=2), **kwargs)
    disk, _ = fit(module, SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path)),
                  callbacks=[Look()], **kwargs)  # fmt: skip
    if small_blocks:  # torch's fused Adam rounds an element differently in the vector body and the tail of a slice
        err, where = max_rel_error(disk, ram)
        assert err < 1e-6, f"{where}: {err:.2e}"
    else:  # the same slices as in RAM
        assert all(torch.equal(disk[k], ram[k]) for k in ram)
    err, where = max_rel_error(disk, ref)
    assert err < 1e-5, f"{where}: {err:.2e}"
    assert seen["modes"] == {"0o600", "0o700"}  # private files in a private directory
    assert seen["resident"] == len(list(module.parameters()))  # only each parameter's step count stays in RAM
    assert not os.path.exists(seen["dir"])  # removed at the end
    assert seen["planned"] == seen["files"]  # the planner's disk need is what the files take
    assert (seen["blocks"] > 1) == small_blocks


@pytest.mark.parametrize("small_blocks", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_nvme_resume_is_exact(tmp_path, monkeypatch, small_blocks):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_slide.engine import nvme

    if small_blocks:  # several blocks per parameter, each with its CRC in the checkpoint
        monkeypatch.setattr(nvme, "rows_per_block", lambda p, n: min(nvme._rows(p), nvme._rows_per_page_unit(p)))

    def strategy():
        return SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path / "nvme"))

    (tmp_path / "nvme").mkdir()
    module = CausalLM(tiny_config("llama"))
    straight, _ = fit(module, strategy(), steps=8)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)  # 4 steps: one epoch
    fit(module, strategy(), steps=4, enable_checkpointing=True, callbacks=[saver])
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert sorted(p.name for p in path.iterdir()) == ["checkpoint.pt", "state"]  # a directory, the files copied in
    state = SlideCheckpointIO().load_checkpoint(path)["optimizer_states"][0]["state"]
    assert all({"step", "exp_avg", "exp_avg_sq"} <= set(s) for s in state.values())  # the moments are in it
    assert all(isinstance(s["exp_avg"], torch.Tensor) for s in state.values())
    assert list((tmp_path / "nvme").iterdir()) == []  # the training run removed its own files
    resumed, _ = fit(module, strategy(), steps=8, ckpt_path=str(path))
    err, where = max_rel_error(resumed, straight)
    assert err == 0, f"{where}: {err:.2e}"
    if not small_blocks:  # (small blocks round differently from whole tensors in the last bit: see above)
        in_ram, _ = fit(module, SlideFormerStrategy(num_slots=2, optimizer_offload="cpu"), steps=8, ckpt_path=str(path))
        err, where = max_rel_error(in_ram, straight)  # the same checkpoint resumes with the state in RAM
        assert err == 0, f"{where}: {err:.2e}"


def _nvme_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    (tmp_path / "nvme").mkdir(exist_ok=True)
    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path / "nvme"))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1, save_last=True)
    fit(CausalLM(tiny_config("llama")), strategy, steps=4, enable_checkpointing=True, callbacks=[saver])
    return strategy, tmp_path / "ckpt"


def test_nvme_checkpoints_rotate_as_directories(tmp_path):
    _, ckpt = _nvme_checkpoint(tmp_path)
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"]  # save_top_k=1 removed the step-2 directory
    assert all((ckpt / n / "state").is_dir() for n in names)


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
def test_a_damaged_checkpoint_state_file_is_named_at_resume(tmp_path, damage):
    _, ckpt = _nvme_checkpoint(tmp_path)
    victim = sorted((ckpt / "last.ckpt" / "state").iterdir())[1]
    if damage == "corrupt":
        with open(victim, "r+b") as f:
            f.write(b"\xff" * 64)
    elif damage == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    said = {"corrupt": "is corrupt", "missing": "is missing", "truncated": "is truncated"}[damage]
    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path / "nvme"))
    with pytest.raises(NvmeStateError, match=rf"{victim.name}.* {said}"):
        fit(CausalLM(tiny_config("llama")), strategy, steps=6, ckpt_path=str(ckpt / "last.ckpt"))
    assert (ckpt / "epoch=0-step=4.ckpt" / "state").is_dir()  # the other checkpoint is untouched


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    _, ckpt = _nvme_checkpoint(tmp_path)
    last = ckpt / "last.ckpt"
    before = sorted(p.name for p in (last / "state").iterdir())
    checkpoint = SlideCheckpointIO().load_checkpoint(last)
    checkpoint["optimizer_states"][0]["state"][0]["exp_avg"] = {"nvme_state_file": "x", "blocks": []}  # a reference
    pieces = [(str(tmp_path / "x"), 0, "x", 0, 4096)]
    with pytest.raises(FileNotFoundError):  # ... whose file is gone
        SlideCheckpointIO().save_checkpoint(checkpoint, last, storage_options={"state_pieces": pieces})
    assert sorted(p.name for p in (last / "state").iterdir()) == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # no partial left


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_state_stops_training_naming_the_file(tmp_path, damage):
    class Damage(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                trainer.strategy.engine.wait()
                store = trainer.strategy.engine.optimizer.store
                store.flush()  # the writes behind this step's updates are on disk
                path = store.paths[1]
                with open(path, "r+b") as f:
                    if damage == "corrupt":
                        f.write(b"\xff" * 64)
                    else:
                        f.truncate(100)

    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path))
    with pytest.raises(NvmeStateError, match=r"State in .*0001-.*\.bin .* is (corrupt|truncated)"):
        fit(CausalLM(tiny_config("llama")), strategy, steps=4, callbacks=[Damage()])


def test_bad_nvme_paths_are_clear_errors(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.delenv("SLIDE_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match="needs a directory on a fast disk"):
        SlideFormerStrategy(optimizer_offload="nvme")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path / "file"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="is not writable"):
        SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path))


def test_too_small_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import shutil

    import lightning_slide.strategy as strategy_module

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(strategy_module.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    strategy = SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path))
    with pytest.raises(OSError, match=r"needs [\d.]+ (KiB|MiB) at nvme_path but only 4\.00 KiB is free there\. "):
        fit(CausalLM(tiny_config("llama")), strategy, steps=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ram", [pytest.param("plenty", marks=pytest.mark.slow), "short"])
def test_auto_puts_the_state_on_nvme_only_when_ram_is_short(tmp_path, monkeypatch, caplog, ram):
    import lightning_slide.strategy as strategy_module

    on_disk, added = [], []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            on_disk.append(trainer.strategy.engine.optimizer.store is not None)
            added.append(trainer.strategy.engine.host_plan().added)

    module = CausalLM(tiny_config("llama"))
    ref, _ = fit(module, SlideFormerStrategy(num_slots=2, optimizer_offload="cpu"), callbacks=[Look()])
    on_disk.clear()
    if ram == "short":  # one byte less than the state in RAM needs; on disk it needs less (no read-ahead here)
        monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: added[0] - 1)
    strategy = SlideFormerStrategy(num_slots=2, nvme_path=str(tmp_path), engine=EngineConfig(nvme_read_ahead_bytes=0))
    with caplog.at_level("INFO"):
        ours, _ = fit(module, strategy, callbacks=[Look()])
    assert set(on_disk) == {ram == "short"}
    assert ("keeps the optimizer state on NVMe" in caplog.text) == (ram == "short")
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_auto_without_a_disk_refuses_short_ram_naming_nvme_path(monkeypatch):
    import lightning_slide.strategy as strategy_module

    monkeypatch.delenv("SLIDE_NVME_PATH", raising=False)
    monkeypatch.setattr(strategy_module, "available_host_bytes", lambda: 1 << 16)
    with pytest.raises(MemoryError, match=r"SlideFormerStrategy\(nvme_path=\.\.\.\) or \$SLIDE_NVME_PATH"):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2), steps=1)


def test_the_nvme_preset_reads_its_directory_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDE_NVME_PATH", str(tmp_path))
    strategy = L.Trainer(strategy="slideformer_nvme", accelerator="cpu", logger=False).strategy
    assert (strategy.optimizer_offload, strategy.nvme_path) == ("nvme", str(tmp_path))


def test_without_direct_io_the_store_falls_back_to_buffered_files(tmp_path, monkeypatch):
    from torch import nn

    from lightning_slide.engine import nvme

    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")  # what tmpfs-like file systems answer
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(nvme.os, "open", no_direct)
    p = nn.Parameter(torch.randn(5, 3))
    store = nvme.NvmeStateStore(str(tmp_path), [("block", [p])], ("exp_avg", "exp_avg_sq"), chunk_numel=1024)
    assert not store.direct
    store.load(p, 0)["exp_avg"].fill_(2.5)
    store.save(p, 0)
    assert store.load(p, 0)["exp_avg"].eq(2.5).all()
    store.save(p, 0)
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_read_ahead_is_bounded_and_reads_see_earlier_writes(tmp_path):
    from torch import nn

    from lightning_slide.engine.nvme import NvmeStateStore

    a, b = nn.Parameter(torch.zeros(1024)), nn.Parameter(torch.zeros(1024))  # 2 x 4 KiB of state each
    keys = ("exp_avg", "exp_avg_sq")
    store = NvmeStateStore(str(tmp_path), [("block", [a, b])], keys, chunk_numel=1024, max_ahead_bytes=3 * 4096)
    store.load(a, 0)["exp_avg"].fill_(1.0)
    store.save(a, 0)  # behind: queued for an I/O thread
    store.prefetch([a, b])  # only a fits in 3 pages
    assert list(store._ahead) == [(a, 0)]
    moments = store.load(a, 0)
    assert moments["exp_avg"].eq(1.0).all()  # the read-ahead waited for the write
    assert list(store._ahead) == [(b, 0)]  # room again: the next block is on its way
    store.load(b, 0)
    store.save(b, 0)
    store.prefetch([a])  # a is being updated: reading it ahead now could run before its write
    assert (a, 0) not in store._ahead
    moments["exp_avg"].fill_(3.0)
    store.save(a, 0)
    assert store.load(a, 0)["exp_avg"].eq(3.0).all()
    store.save(a, 0)
    store.close()


def test_stores_holding_shares_of_the_rows_make_the_checkpoint_one_store_makes(tmp_path):
    # a node's 3 processes each hold their rows of every parameter (SharedHost.rows: shares that split pages, a
    # scalar held by the first only) in files of their own; the checkpoint lays the state out as one store does
    from torch import nn

    from lightning_slide.engine.nvme import NvmeStateStore, merged
    from lightning_slide.engine.shared_host import SharedHost

    params = [nn.Parameter(torch.zeros(1000, 3)), nn.Parameter(torch.zeros(7)), nn.Parameter(torch.zeros(()))]
    values = [torch.randn(p.shape) for p in params]
    keys = ("exp_avg", "exp_avg_sq")

    def store(rank: int | None) -> NvmeStateStore:
        host = SharedHost.on_paper(3)
        host.rank = rank
        own_rows = {p: host.rows(p) for p in params} if rank is not None else None
        made = NvmeStateStore(str(tmp_path / "live"), [("block", params)], keys, chunk_numel=1024, own_rows=own_rows)
        for p, value in zip(params, values):
            for k, key in enumerate(keys):
                made.write(p, key, value + k)
        return made

    (tmp_path / "live").mkdir()
    one, shares = store(None), [store(rank) for rank in range(3)]
    assert [s.first.get(params[0]) for s in shares] == [0, 334, 668]
    assert params[2] not in shares[1].regions
    assert sum(s.regions[params[0]]["exp_avg"].nbytes for s in shares) == 1000 * 3 * 4  # each process its rows only
    for p, value in zip(params, values):  # each process's rows, read back into one tensor
        out = torch.full(p.shape, float("nan"))
        for s in shares:
            s.read(p, "exp_avg", out)
        assert torch.equal(out, value)

    def saved(stores: list[NvmeStateStore], name: str) -> dict:
        parts = [{(i, key): ref for i, p in enumerate(params) if p in s.regions for key, ref in s.reference(p).items()}
                 for s in stores]  # fmt: skip
        state = {i: {key: merged([part[i, key] for part in parts if (i, key) in part]) for key in keys}
                 for i in range(3)}  # fmt: skip
        pieces = [piece for s in stores for piece in s.pieces()]
        checkpoint = {"state_dict": {}, "optimizer_states": [{"state": state, "param_groups": []}]}
        SlideCheckpointIO().save_checkpoint(checkpoint, tmp_path / name, storage_options={"state_pieces": pieces})
        return SlideCheckpointIO().load_checkpoint(tmp_path / name)["optimizer_states"][0]["state"]

    by_one, by_three = saved([one], "one.ckpt"), saved(shares, "three.ckpt")
    for i, value in enumerate(values):
        for k, key in enumerate(keys):
            assert torch.equal(by_one[i][key], value + k)
            assert torch.equal(by_three[i][key], value + k)

    def files(name: str) -> list[tuple[str, int]]:
        return [(f.name, f.stat().st_size) for f in sorted((tmp_path / name / "state").iterdir())]

    assert files("one.ckpt") == files("three.ckpt")
    for s in [one, *shares]:
        s.close()


def test_a_large_parameter_moves_in_checksummed_row_blocks(tmp_path):
    # a parameter's state is split into row blocks of whole pages, read, written and checked one by one: a large
    # embedding never has its whole state in RAM
    from torch import nn

    from lightning_slide.engine import nvme

    p = nn.Parameter(torch.zeros(5000, 2))  # 8 bytes per row: 512 rows fill a page
    store = nvme.NvmeStateStore(str(tmp_path), [("embed", [p])], ("exp_avg",), chunk_numel=1100, io_threads=3)
    assert store.rows[p] == 512
    assert store.blocks(p, None)[-1] == (slice(4608, 5000), 9)
    values = torch.randn(5000, 2)
    for rows, block in store.blocks(p, None):
        store.load(p, block)["exp_avg"].copy_(values[rows])
        store.save(p, block)
    store.flush()
    assert None not in store.regions[p]["exp_avg"].crcs
    assert torch.equal(torch.cat([store.load(p, b)["exp_avg"] for b in range(10)]), values)
    for b in range(10):
        store.save(p, b)
    store.flush()
    with open(store.paths[0], "r+b") as f:  # flip a byte in the fourth block
        f.seek(3 * 4096 + 7)
        byte = f.read(1)
        f.seek(3 * 4096 + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert torch.equal(store.load(p, 2)["exp_avg"], values[1024:1536])
    with pytest.raises(nvme.NvmeStateError, match=r"exp_avg of embed: \(5000, 2\), bytes 12288..16384\) is corrupt"):
        store.load(p, 3)
    store.close()


def test_nvme_state_needs_the_directory_checkpoint_io(tmp_path):
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    strategy = SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path), checkpoint_io=TorchCheckpointIO())
    with pytest.raises(ValueError, match="SlideCheckpointIO"):
        fit(CausalLM(tiny_config("llama")), strategy, steps=1)
    assert list(tmp_path.iterdir()) == []  # refused before the state files were made


def _masters_strategy(path) -> SlideFormerStrategy:
    return SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(path), nvme_masters=True)


@pytest.mark.parametrize(("clip", "accumulate"), [(None, 1), (0.05, 1), pytest.param(None, 2, marks=pytest.mark.slow)])
def test_nvme_masters_train_exactly_like_ram(tmp_path, clip, accumulate):
    seen = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            engine = trainer.strategy.engine
            engine.wait()
            seen["copies"] = {p.dtype for p in engine.disk_masters}
            seen["count"] = len(engine.disk_masters)
            seen["planned"] = engine.host_plan().disk
            seen["files"] = sum(os.path.getsize(p) for p in engine.optimizer.store.paths)
            seen["planned_ram"] = engine.host_plan().masters
            seen["ram"] = sum(p.numel() * p.element_size() for p in module.parameters())

    module = CausalLM(tiny_config("llama", tied=True))
    kwargs = dict(precision="bf16-mixed", gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    ram, _ = fit(module, SlideFormerStrategy(num_slots=2), **kwargs)
    disk, trained = fit(module, _masters_strategy(tmp_path), callbacks=[Look()], **kwargs)
    assert all(torch.equal(disk[k], ram[k]) for k in ram)
    assert seen["copies"] == {torch.bfloat16}
    assert seen["count"] == 4 * 7  # q k v o gate up down of 4 blocks
    assert {p.dtype for p in trained.parameters()} == {torch.float32}  # the fp32 masters came back
    assert seen["planned"] == seen["files"]  # moments and masters
    assert seen["planned_ram"] == seen["ram"]  # bf16 copies of the block matrices, the rest fp32
    assert seen["ram"] < 0.8 * sum(p.numel() * 4 for p in module.parameters())


def _in_bf16(module):
    # a copy of ``module`` whose block matrices are bf16 (a model loaded in bf16), and the fp32 module with the
    # same values
    exact = CausalLM(module.model.config)
    exact.load_state_dict(module.state_dict())
    for layer in exact.model.model.layers:
        for p in layer.parameters():
            if p.dim() >= 2:
                p.data = p.data.to(torch.bfloat16).float()
    loaded = CausalLM(module.model.config)
    loaded.load_state_dict(exact.state_dict())
    for layer in loaded.model.model.layers:
        for p in layer.parameters():
            if p.dim() >= 2:
                p.data = p.data.to(torch.bfloat16)
    return exact, loaded


@pytest.mark.slow
def test_a_model_loaded_in_bf16_gets_exact_fp32_masters_and_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    exact, loaded = _in_bf16(CausalLM(tiny_config("llama")))
    (tmp_path / "nvme").mkdir()
    seen = {}

    class Look(L.Callback):
        def on_train_start(self, trainer, module):
            seen["planned"] = trainer.strategy.plan.host.masters
            seen["ram"] = sum(p.numel() * p.element_size() for p in module.parameters())

    ram, _ = fit(exact, SlideFormerStrategy(num_slots=2), precision="bf16-mixed", steps=8)
    disk, _ = fit(loaded, _masters_strategy(tmp_path / "nvme"), precision="bf16-mixed", steps=8, callbacks=[Look()])
    assert all(torch.equal(disk[k], ram[k]) for k in ram)
    # the block matrices stay bf16 in RAM (their fp32 masters are written to disk, never widened in RAM first)
    assert seen["planned"] == seen["ram"] < sum(p.numel() * 4 for p in loaded.parameters())

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)
    fit(loaded, _masters_strategy(tmp_path / "nvme"), precision="bf16-mixed", steps=4, enable_checkpointing=True,
        callbacks=[saver])  # fmt: skip
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    raw = torch.load(path / "checkpoint.pt", weights_only=True, mmap=True)["state_dict"]
    weights = SlideCheckpointIO.load_weights(path)["state_dict"]
    name = "model.model.layers.0.mlp.up_proj.weight"
    assert "nvme_state_file" in raw[name]  # not a second copy: a reference
    assert weights[name].dtype == torch.float32
    resumed, _ = fit(loaded, _masters_strategy(tmp_path / "nvme"), precision="bf16-mixed", steps=8,
                     ckpt_path=str(path))  # fmt: skip
    assert all(torch.equal(resumed[k], ram[k]) for k in ram)  # the bf16 model resumed from its fp32 masters


def test_nvme_masters_need_the_nvme_tier_and_bf16(tmp_path):
    with pytest.raises(ValueError, match="nvme_masters=True keeps the masters beside Adam's state on disk"):
        SlideFormerStrategy(nvme_masters=True, nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        fit(CausalLM(tiny_config("llama")), _masters_strategy(tmp_path))  # 32-true
    assert list(tmp_path.iterdir()) == []  # refused before a file was made


def _crafted(ckpt, change):
    # ``ckpt``'s checkpoint.pt with its first optimizer-state reference changed by ``change``
    file = ckpt / "checkpoint.pt"
    raw = torch.load(file, weights_only=True)
    ref = raw["optimizer_states"][0]["state"][0]["exp_avg"]
    change(ref)
    torch.save(raw, file)
    return ref


@pytest.mark.parametrize("craft", ["absolute", "parent", "symlink", "no checksum", "none is not zeros", "malformed"])
def test_a_crafted_state_reference_is_refused_and_reads_nothing_outside(tmp_path, craft):
    _, ckpt = _nvme_checkpoint(tmp_path)
    last = ckpt / "last.ckpt"
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"\x01" * (1 << 20))
    state = last / "state"
    first = sorted(state.iterdir())[0].name
    changes = {
        "absolute": lambda ref: ref.update(nvme_state_file=str(outside), blocks=[[n, None] for n, _ in ref["blocks"]]),
        "parent": lambda ref: ref.update(nvme_state_file="../../../secret.bin"),
        "symlink": lambda ref: ref.update(nvme_state_file="link.bin"),
        "no checksum": lambda ref: ref.update(blocks=[]),
        "none is not zeros": lambda ref: ref.update(nvme_state_file=first, offset=0, blocks=[[ref["nbytes"], None]]),
        "malformed": lambda ref: ref.update(offset=-4096),
    }
    (state / "link.bin").symlink_to(outside)
    _crafted(last, changes[craft])
    error = NvmeStateError if craft == "none is not zeros" else ValueError
    where = r"optimizer_states\[0\]\['state'\]\[0\]\['exp_avg'\]"
    match = "corrupt" if craft == "none is not zeros" else rf"Checkpoint '{last}' holds a state reference at {where}"
    with pytest.raises(error, match=match):
        SlideCheckpointIO().load_checkpoint(last)
    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path=str(tmp_path / "nvme"))
    with pytest.raises(error, match=match):
        fit(CausalLM(tiny_config("llama")), strategy, steps=6, ckpt_path=str(last))


def test_a_crafted_weight_reference_is_refused_by_export_loads(tmp_path):
    _, ckpt = _nvme_checkpoint(tmp_path)
    last = ckpt / "last.ckpt"
    file = last / "checkpoint.pt"
    raw = torch.load(file, weights_only=True)
    name = "model.model.norm.weight"
    ref = {**raw["optimizer_states"][0]["state"][0]["exp_avg"], "nvme_state_file": "/etc/hostname"}
    raw["state_dict"][name] = ref
    raw.pop("slide_checksums")  # (with them, the missing tensor is refused first)
    torch.save(raw, file)
    with pytest.raises(ValueError, match=rf"state_dict\['{name}'\] that names '/etc/hostname', not a file name"):
        SlideCheckpointIO.load_weights(last)


def test_the_saved_state_copies_are_private(tmp_path):
    _, ckpt = _nvme_checkpoint(tmp_path)
    last = ckpt / "last.ckpt"
    assert {oct(p.stat().st_mode & 0o777) for p in (last, last / "state")} == {oct(0o700)}
    assert {oct(p.stat().st_mode & 0o777) for p in (last / "state").iterdir()} == {oct(0o600)}


@pytest.mark.parametrize("crash", ["between the renames", "before the second rename's cleanup", "mid-write"])
def test_a_save_killed_while_replacing_a_directory_checkpoint_is_recovered(tmp_path, crash):
    # the state a SIGKILL leaves at each point of SlideCheckpointIO._replace, made by hand from two real checkpoints
    import shutil

    _, ckpt = _nvme_checkpoint(tmp_path)
    last, newer = ckpt / "last.ckpt", ckpt / "epoch=0-step=4.ckpt"
    older = ckpt / "older"
    shutil.copytree(last, older)  # (last and step 4 are the same step; make "older" look older through its step)
    raw = torch.load(older / "checkpoint.pt", weights_only=True)
    raw["global_step"] = 2
    torch.save(raw, older / "checkpoint.pt")
    shutil.rmtree(last)
    if crash == "between the renames":
        older.rename(ckpt / "last.ckpt.old")
        shutil.copytree(newer, ckpt / "last.ckpt.partial")  # complete: it is renamed only once synced
        expected = 4
    elif crash == "before the second rename's cleanup":
        older.rename(ckpt / "last.ckpt.old")
        shutil.copytree(newer, last)
        expected = 4
    else:
        older.rename(last)
        (ckpt / "last.ckpt.partial").mkdir()  # a half-written new one
        expected = 2
    loaded = SlideCheckpointIO().load_checkpoint(last)  # resume finds the newest complete one
    assert loaded["global_step"] == expected
    SlideCheckpointIO().save_checkpoint({"global_step": 9}, ckpt / "other.ckpt")  # a later save tidies up
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt", "other.ckpt"]
    assert SlideCheckpointIO().load_checkpoint(last)["global_step"] == expected


KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import lightning as L
from helpers import CausalLM, fit, tiny_config
from lightning_slide import SlideFormerStrategy

class Kill(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: no cleanup runs

strategy = SlideFormerStrategy(num_slots=2, optimizer_offload="nvme", nvme_path={nvme!r})
fit(CausalLM(tiny_config("llama")), strategy, steps=4, callbacks=[Kill()])
"""


@pytest.mark.slow
def test_state_left_by_a_killed_run_is_removed_by_the_next_and_live_state_is_counted(
    tmp_path, tmp_path_factory, monkeypatch, caplog
):
    import shutil
    import signal

    import forked_runs

    import lightning_slide.strategy as strategy_module
    from lightning_slide.engine import state_dirs

    script = tmp_path_factory.mktemp("script") / "killed.py"  # not in the state folder: it holds what the run leaves
    script.write_text(KILLED_RUN.format(tests=os.path.dirname(__file__), nvme=str(tmp_path)))
    done = forked_runs.run(str(script), processes=1)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1  # the state the killed run held
    assert left[0].startswith(state_dirs.STATE_PREFIX)
    # another run's live state on the same disk (this process holds its owner lock)
    live, owner = state_dirs.make_state_dir(str(tmp_path))
    with open(os.path.join(live, "state.bin"), "wb") as f:
        f.write(b"x" * (3 << 20))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(strategy_module.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    strategy = SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path))
    held = r"only 4\.00 KiB is free there \(3\.\d+ MiB more is held by other running"
    with caplog.at_level("WARNING", logger="lightning_slide.engine.state_dirs"), pytest.raises(OSError, match=held):
        fit(CausalLM(tiny_config("llama")), strategy, steps=1)
    assert f"Removed {left[0]}" in caplog.text
    assert "left by a run that was killed (pid " in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(live)]  # the live one untouched
    os.close(owner)
    monkeypatch.undo()
    fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path)), steps=1)
    assert list(tmp_path.iterdir()) == []  # its owner gone, the next run removed it; and left nothing of its own


@pytest.mark.parametrize("report", ["space left", "errno inside"])
def test_a_full_disk_at_save_names_the_checkpoint_and_the_space(tmp_path, monkeypatch, report):
    import errno
    import shutil

    from lightning_slide import checkpoint_io

    _, ckpt = _nvme_checkpoint(tmp_path)
    last = ckpt / "last.ckpt"
    checkpoint = SlideCheckpointIO().load_checkpoint(last)
    saved = torch.save

    def fills_the_disk(obj, f):  # as torch's writer fails on a full disk, after writing part of the file
        f.write(b"x" * 4096)
        if report == "space left":
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 4096")
        try:  # what it raised on a 2 MB tmpfs: its RuntimeError while handling the write's OSError
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    # "space left": the free space, once the partial file is gone, is short of the checkpoint; "errno inside": it
    # is not (the partial file had taken the space), and only the write's own error tells
    free = 12 << 10 if report == "space left" else 1 << 40
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint_io.torch, "save", fills_the_disk)
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda path: usage._replace(free=free))
    full = rf"Saving checkpoint .*other\.ckpt failed: its disk is full \({checkpoint_io.size_text(free)} free"
    with pytest.raises(OSError, match=full) as e:
        SlideCheckpointIO().save_checkpoint({"w": torch.zeros(1 << 16)}, ckpt / "other.ckpt")
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]  # nothing partial left
    monkeypatch.setattr(checkpoint_io.torch, "save", saved)
    assert SlideCheckpointIO().load_checkpoint(last)["global_step"] == checkpoint["global_step"]


def test_a_disk_too_full_for_the_nvme_state_fails_at_setup_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    strategy = SlideFormerStrategy(optimizer_offload="nvme", nvme_path=str(tmp_path))
    module = CausalLM(tiny_config("llama"))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(OSError, match=r"The disk at nvme_path .* filled while SlideFormer reserved"):
        fit(module, strategy, steps=1)
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_flipped_bit_in_the_weights_or_the_ram_state_is_refused(tmp_path, tier):
    from lightning.pytorch.callbacks import ModelCheckpoint

    (tmp_path / "nvme").mkdir()
    strategy = SlideFormerStrategy(num_slots=2, optimizer_offload=tier, nvme_path=str(tmp_path / "nvme"))
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    fit(CausalLM(tiny_config("llama")), strategy, steps=2, enable_checkpointing=True, callbacks=[saver])
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    file = path / "checkpoint.pt" if path.is_dir() else path
    raw = torch.load(file, weights_only=True)
    victim = "['state_dict']['model.model.layers.1.mlp.up_proj.weight']"
    assert victim in raw["slide_checksums"]
    if tier == "cpu":  # the RAM tier's Adam state is in the file too
        assert any(k.startswith("['optimizer_states'][0]['state']") for k in raw["slide_checksums"])
    weight = raw["state_dict"]["model.model.layers.1.mlp.up_proj.weight"]
    data = file.read_bytes()
    at = data.find(weight.numpy().tobytes())  # the tensor's bytes, stored as they are
    assert at > 0
    flipped = bytearray(data)
    flipped[at + 5] ^= 0x10
    file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=rf"is damaged: its tensor at {re.escape(victim)} does not match"):
        SlideCheckpointIO().load_checkpoint(path)
    with pytest.raises(CheckpointError, match=re.escape(victim)):  # export's load: the weights alone, checked
        SlideCheckpointIO.load_weights(path)
    with pytest.raises(CheckpointError):
        fit(CausalLM(tiny_config("llama")), SlideFormerStrategy(num_slots=2, optimizer_offload=tier,
            nvme_path=str(tmp_path / "nvme")), steps=4, ckpt_path=str(path))  # fmt: skip
    if tier == "cpu":  # a flipped bit in Adam's state stops a resume, not an export of the weights
        moment = next(v["exp_avg"] for v in raw["optimizer_states"][0]["state"].values() if v["exp_avg"].numel() > 64)
        at = data.find(moment.numpy().tobytes())
        flipped = bytearray(data)
        flipped[at + 5] ^= 0x10
        file.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match=r"\['optimizer_states'\]"):
            SlideCheckpointIO().load_checkpoint(path)
        weights = SlideCheckpointIO.load_weights(path)["state_dict"]
        assert torch.equal(weights["model.model.layers.1.mlp.up_proj.weight"], weight)
