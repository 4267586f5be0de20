"""Data parallel on the CPU (gloo): ``devices=N`` trains as Lightning's DDP with the same global batch."""

import json
import os
import re
import subprocess
import sys

import forked_runs
import pytest
import torch

from helpers import USER_ENV, max_rel_error, tiny_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_parallel_run.py")


def _run(strategy: str, out, *options: str, forked: bool = True) -> subprocess.CompletedProcess:
    # forked: the processes forked with the imports done (forked_runs.py); else as a user starts the script
    if forked:
        processes, nodes = (int(options[options.index(o) + 1]) if o in options else n for o, n in
                            (("--devices", 2), ("--num-nodes", 1)))  # fmt: skip
        return forked_runs.run(SCRIPT, strategy, str(out), *options, processes=processes, nodes=nodes)
    command = [sys.executable, SCRIPT, strategy, str(out), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=USER_ENV)


def _trained(strategy: str, out, *options: str, forked: bool = True) -> dict:
    done = _run(strategy, out, *options, forked=forked)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def _matches_ddp(tmp_path, *options: str, launched: bool = False) -> None:
    # launched: ours started as a user starts the script (Lightning's launcher starts the others)
    ddp = _trained("ddp", tmp_path / "ddp.pt", *options)  # the options of SlideFormerStrategy are ignored
    ours = _trained("slideformer", tmp_path / "ours.pt", *options, forked=not launched)
    err, where = max_rel_error(ours, ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"


def _every_process_holds_the_trained_weights(tmp_path, devices: int) -> None:
    # after fit, as under DDP: each process's module (the others started from no weights of their own)
    weights = [json.loads((tmp_path / f"report.{rank}").read_text())["weights"] for rank in range(devices)]
    assert all(w == weights[0] for w in weights[1:])


@pytest.mark.slow
def test_two_processes_train_as_ddp(tmp_path):
    # tied embeddings, AdamW with two param groups and a scheduler (helpers.CausalLM); each process starts from
    # other weights: the first process's reach the others, as under DDP
    _matches_ddp(tmp_path, "--seed-per-rank", launched=True)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["whole", "gpu-tier"])
def test_processes_keeping_units_on_the_device_train_as_ddp(tmp_path, tier):
    # a device budget on the CPU: the whole model on the device, or (the whole "not fitting") the GPU tier keeping the
    # embedding, the head, the norm and blocks 0-2 there
    options = ["--device-memory-gib", "2", "--clip", "0.05", "--accumulate", "2"]
    options += ["--not-whole"] if tier == "gpu-tier" else []
    ddp = _trained("ddp", tmp_path / "ddp.pt", *options)
    done = _run("slideformer", tmp_path / "ours.pt", *options, "--report", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr[-3000:]
    kept = "'model.model.layers.2'" + (", 'model.model.layers.3'" if tier == "whole" else "]")
    assert kept in done.stdout
    err, where = max_rel_error(torch.load(tmp_path / "ours.pt"), ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"
    _every_process_holds_the_trained_weights(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "clip", "accumulate", "schedule"),
    [(2, "0.05", "2", "auto"), (2, "0.05", "1", "norm-first"), (3, "0.05", "2", "auto"), (3, None, "1", "auto")],
)
def test_processes_with_clipping_and_accumulation_train_as_ddp(tmp_path, devices, clip, accumulate, schedule):
    options = ["--devices", str(devices), "--accumulate", accumulate, "--schedule", schedule]
    _matches_ddp(tmp_path, *options, *(["--clip", clip] if clip else []))


@pytest.mark.slow
def test_a_checkpoint_of_processes_resumes_exactly(tmp_path):
    # 32 rows, 2 processes, 2 rows each: an epoch is 8 steps (a plain DataLoader resumes exactly at an epoch's end)
    straight = _trained("slideformer", tmp_path / "straight.pt", "--steps", "12", "--save-at", "8")
    checkpoint = str(tmp_path / "step=8.ckpt")
    resumed = _trained("slideformer", tmp_path / "resumed.pt", "--steps", "12", "--resume", checkpoint)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.slow
@pytest.mark.parametrize(("saved_by", "resumed_by", "nvme"), [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_a_checkpoint_resumes_on_another_number_of_processes(tmp_path, saved_by, resumed_by, nvme):
    # the same global batches (4 rows) on 1 or 2 processes (TextDataModule); the checkpoint, mid-epoch, holds the
    # whole state whoever saved it (on NVMe, each process's rows in its own files: the checkpoint joins them)
    (tmp_path / "nvme").mkdir()

    def on(devices: int) -> list[str]:
        options = ["--text", "step", "--steps", "12", "--devices", str(devices), "--batch-size", str(4 // devices)]
        return options + (["--nvme-path", str(tmp_path / "nvme")] if nvme else [])

    straight = _trained("slideformer", tmp_path / "straight.pt", *on(saved_by), "--save-at", "5")
    checkpoint = str(tmp_path / "step=5.ckpt")
    resumed = _trained("slideformer", tmp_path / "resumed.pt", *on(resumed_by), "--resume", checkpoint)
    err, where = max_rel_error(resumed, straight)
    assert err < 1e-5, f"{where}: {err:.2e}"


@pytest.mark.slow
def test_text_data_on_two_processes_trains_as_one_process_with_their_batches(tmp_path):
    # CausalLMModule on TextDataModule, loss normalized by the step's tokens: two processes of 2 rows are one of 4
    # the second process reads no weights: it builds the model on the meta device and maps the first one's
    options = ["--text", "step", "--accumulate", "2"]
    one = _trained("slideformer", tmp_path / "one.pt", *options, "--devices", "1", "--batch-size", "4")
    report = str(tmp_path / "report")
    two = _trained(
        "slideformer", tmp_path / "two.pt", *options, "--devices", "2", "--batch-size", "2", "--report", report
    )
    err, where = max_rel_error(two, one)
    assert err < 1e-5, f"{where}: {err:.2e}"
    built_on_meta = [json.loads((tmp_path / f"report.{rank}").read_text())["built_on_meta"] for rank in range(2)]
    assert built_on_meta == [False, True]


@pytest.mark.slow
def test_a_process_building_on_the_meta_device_draws_the_dropout_masks_of_ddp(tmp_path):
    # CausalLMModule from a config: the second process builds on the meta device (no initial values drawn) and takes
    # the first one's random state, which a DDP process has after drawing them (otherwise 0.17 apart after 4 steps)
    _matches_ddp(tmp_path, "--text", "step", "--dropout", "0.2")


@pytest.mark.slow
def test_a_module_loading_its_weights_once_per_node_trains_as_ddp(tmp_path):
    # the README's configure_model: from_pretrained of a local directory where strategy.loads_weights, the meta
    # device elsewhere (DDP: every process loads)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("llama", tied=True)).save_pretrained(tmp_path / "model")
    options = ["--pretrained", str(tmp_path / "model"), "--clip", "0.05"]
    ddp = _trained("ddp", tmp_path / "ddp.pt", *options)
    ours = _trained("slideformer", tmp_path / "ours.pt", *options, "--report", str(tmp_path / "report"))
    err, where = max_rel_error(ours, ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"
    built_on_meta = [json.loads((tmp_path / f"report.{rank}").read_text())["built_on_meta"] for rank in range(2)]
    assert built_on_meta == [False, True]


@pytest.mark.slow
def test_bf16_state_shared_out_by_processes_trains_as_one_process(tmp_path):
    # each process updates its rows of the moments in the memory the node's processes share; the random rounding
    # follows each element's index in its parameter, so two processes round as one does (but where the gradients'
    # last bits, summed in another order, tip an element's rounding: far less than bf16's own difference from fp32)
    options = ["--text", "step", "--report", str(tmp_path / "report")]
    one = ["--devices", "1", "--batch-size", "4"]
    fp32 = _trained("slideformer", tmp_path / "fp32.pt", *options, *one)
    bf16 = ["--optimizer-state", "bf16"]
    one = _trained("slideformer", tmp_path / "one.pt", *options, *bf16, *one)
    two = _trained("slideformer", tmp_path / "two.pt", *options, *bf16, "--devices", "2", "--batch-size", "2")
    err, where = max_rel_error(two, one)
    assert err < 0.1 * max_rel_error(one, fp32)[0], f"{where}: {err:.2e}"
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(2)]
    assert all(r["inodes"] == reports[0]["inodes"] and r["private"] == 0 for r in reports)


@pytest.mark.slow
def test_text_data_on_processes_resumes_exactly_mid_epoch(tmp_path):
    options = ["--text", "batch", "--steps", "12"]
    straight = _trained("slideformer", tmp_path / "straight.pt", *options, "--save-at", "5")
    resumed = _trained("slideformer", tmp_path / "resumed.pt", *options, "--resume", str(tmp_path / "step=5.ckpt"))
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def _torchrun(out, *options: str) -> dict:
    # two processes started by torchrun (Lightning's TorchElasticEnvironment)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(forked_runs.free_port()), SCRIPT, "slideformer", str(out), *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=USER_ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
def test_processes_started_by_torchrun_train_as_ddp(tmp_path):
    ours = _torchrun(tmp_path / "ours.pt", "--clip", "0.05")
    ddp = _trained("ddp", tmp_path / "ddp.pt", "--clip", "0.05")
    err, where = max_rel_error(ours, ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"


@pytest.mark.slow
def test_two_nodes_each_holding_the_state_once_train_as_ddp(tmp_path):
    # 2 "nodes" of 2 processes, all on this machine: each node maps its own copy of the state, its two processes half
    # of every parameter's rows; the same 4 processes' global batches as DDP's
    options = ["--devices", "2", "--num-nodes", "2", "--report", str(tmp_path / "report")]
    ours = _trained("slideformer", tmp_path / "ours.pt", *options)
    one_node = _trained("slideformer", tmp_path / "one_node.pt", "--devices", "4")
    err, where = max_rel_error(ours, one_node)
    assert err < 1e-5, f"{where}: {err:.2e}"
    # DDP sums the 4 processes' gradients in other orders (gloo's ring): measured 2.4e-5 from either of ours, 7e-7
    # between them (Adam turns the last bits of small gradients into whole updates)
    ddp = _trained("ddp", tmp_path / "ddp.pt", "--devices", "4")
    err, where = max_rel_error(ours, ddp)
    assert err < 5e-5, f"{where}: {err:.2e}"
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(4)]
    assert reports[0]["inodes"] == reports[1]["inodes"] != reports[2]["inodes"] == reports[3]["inodes"]
    numel = sum(v.numel() for k, v in ours.items() if k != "model.lm_head.weight")  # tied to the embedding
    assert sum(r["updated"] for r in reports[:2]) == sum(r["updated"] for r in reports[2:]) == 4 * numel


def test_step_batches_split_each_global_batch_among_the_processes():
    from lightning_slide.data import ResumableSampler, _Rows, _StepBatches

    rows = _Rows({"input_ids": torch.zeros(23, 4)})
    targets = torch.arange(23)

    def batches(replicas, rank, batch_size):
        sampler = ResumableSampler(23, seed=3)
        return list(_StepBatches(rows, sampler, batch_size, 2, targets, replicas, rank))

    one = batches(1, 0, 6)  # 4 batches: 6, 6, 6, 5 rows
    two = [batches(2, r, 3) for r in range(2)]  # the same 4 global batches; the last one's odd row left out
    assert [len(b) for b in two[0]] == [len(b) for b in two[1]] == [3, 3, 3, 2]
    for whole, first, second in zip(one, *two):
        assert [i for i, _ in first + second] == [i for i, _ in whole][: len(first) * 2]
    for step in (slice(0, 2), slice(2, 4)):  # accumulate=2: the step's tokens count both processes' rows
        used = [pair for rank in two for batch in rank[step] for pair in batch]
        assert {t for _, t in used} == {int(sum(targets[i] for i, _ in used))}
    assert len(_StepBatches(rows, ResumableSampler(23, seed=3), 3, 2, targets, 2, 0)) == 4


@pytest.mark.slow
def test_the_nvme_tier_on_processes_trains_as_ddp_and_resumes_exactly(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ddp = _trained("ddp", tmp_path / "ddp.pt", "--steps", "12")
    options = ["--nvme-path", str(nvme), "--steps", "12"]
    report = ["--report", str(tmp_path / "report")]
    straight = _trained("slideformer", tmp_path / "straight.pt", *options, *report, "--save-at", "8")
    assert (tmp_path / "step=8.ckpt" / "state").is_dir()  # a directory checkpoint: the tier was used
    resumed = _trained("slideformer", tmp_path / "resumed.pt", *options, "--resume", str(tmp_path / "step=8.ckpt"))
    err, where = max_rel_error(straight, ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert not any(nvme.iterdir())  # each process's state went with it
    # the masters once, in the memory the processes share; each process's files hold its rows' two moments only
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(2)]
    assert reports[0]["inodes"] == reports[1]["inodes"] != []
    numel = sum(v.numel() for k, v in straight.items() if k != "model.lm_head.weight")  # tied to the embedding
    disk = [r["on_disk"] for r in reports]
    assert 8 * numel <= sum(disk) <= 8 * numel + 2 * 4096 * len(straight)
    assert max(disk) <= 0.6 * sum(disk)


@pytest.mark.slow
def test_masters_on_nvme_shared_out_by_processes_train_as_in_ram_and_resume_exactly(tmp_path):
    # bf16-mixed, the blocks' fp32 masters on disk too: each process writes its rows of the first one's values (the
    # second holds none) and its rows' masters come back into the memory the processes share as fit ends
    from lightning_slide.checkpoint_io import SlideCheckpointIO

    for folder in ("nvme", "ram", "disk"):
        (tmp_path / folder).mkdir()
    options = ["--precision", "bf16-mixed", "--steps", "12", "--clip", "0.05", "--save-at", "8"]
    ram = _trained("slideformer", tmp_path / "ram" / "out.pt", *options)
    disk_options = [*options, "--nvme-path", str(tmp_path / "nvme"), "--nvme-masters"]
    report = ["--report", str(tmp_path / "report")]
    disk = _trained("slideformer", tmp_path / "disk" / "out.pt", *disk_options, *report)
    assert all(torch.equal(disk[k], ram[k]) for k in ram)
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(2)]
    assert all(r["dtypes"] == ["torch.float32"] for r in reports)  # the fp32 masters came back
    on_disk = [r["on_disk"] for r in reports]  # each process's files: its rows' moments and masters
    assert max(on_disk) <= 0.6 * sum(on_disk)
    _every_process_holds_the_trained_weights(tmp_path, 2)
    # the checkpoint's weights (what `slide export` reads): the fp32 masters, joined from both processes' files
    saved = [SlideCheckpointIO.load_weights(tmp_path / f / "step=8.ckpt")["state_dict"] for f in ("ram", "disk")]
    assert all(torch.equal(saved[1][k], saved[0][k]) for k in saved[0])
    checkpoint = str(tmp_path / "disk" / "step=8.ckpt")
    resumed = _trained("slideformer", tmp_path / "resumed.pt", *disk_options, "--resume", checkpoint)
    assert all(torch.equal(resumed[k], ram[k]) for k in ram)
    assert not any((tmp_path / "nvme").iterdir())


@pytest.mark.slow
def test_a_process_that_dies_stops_the_others_with_an_error(tmp_path):
    # the processes started side by side (no launcher watches them): the first one fails at its next gradient average
    done = _run("slideformer", tmp_path / "ours.pt", "--die-at", "2")
    assert done.returncode != 0
    assert "with the other 1 process(es) failed: one of them stopped" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_process_that_stops_answering_stops_the_others_at_the_timeout(tmp_path):
    # the last process sleeps 35 s at step 2: the first one's collectives give up after the 15 s timeout (which the
    # processes' rendezvous takes too: enough for forked processes, which reach it side by side)
    done = _run("slideformer", tmp_path / "ours.pt", "--stall-at", "2", "--timeout", "15")
    assert done.returncode != 0
    assert "with the other 1 process(es) failed: one of them stopped" in done.stderr, done.stderr[-3000:]
    stalled = float((tmp_path / "ours.pt.stall").read_text())
    first = min(float(s) for s in re.findall(r"stopped at ([\d.]+)", done.stderr))
    assert first - stalled < 35, done.stderr[-3000:]  # it did not wait for the last one to wake


@pytest.mark.parametrize(
    ("loader", "said"),
    [
        ("sized", "(process 0: 3 batches per epoch, process 1: 4 batches per epoch)"),
        pytest.param(
            "iterable", "(process 0: no batch more after 3, process 1: a batch more after 3)", marks=pytest.mark.slow
        ),
    ],
)
def test_unequal_batch_counts_stop_every_process_with_an_error(tmp_path, loader, said):
    # 3 batches per epoch on the first process, 4 on the second: found as the first epoch starts, or (a loader of no
    # length) as the first process's data ends
    done = _run("slideformer", tmp_path / "ours.pt", "--uneven", loader, "--steps", "10")
    assert done.returncode != 0
    assert f"unequal numbers of training batches {said}" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, "0.05"])
def test_a_non_finite_gradient_in_one_process_stops_every_process(tmp_path, clip):
    # the last process's loss is NaN at step 2: its gradients, averaged, reach every process's rows; each process
    # checks its own rows (or the norm, summed), and all of them stop with the error, none waits for the others
    done = _run(
        "slideformer", tmp_path / "ours.pt", "--nan-at", "2", "--devices", "3", *(["--clip", clip] if clip else [])
    )
    assert done.returncode != 0
    assert done.stderr.count("Non-finite gradient (NaN or Inf) at optimizer step 2") >= 1, done.stderr[-3000:]
    assert "process(es) failed: one of them stopped" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_hook_changing_the_shared_gradients_is_refused_before_the_update(tmp_path):
    # clipping shows the step's gradients as param.grad; the node's processes hold them once, so a callback halving
    # them in every process would quarter them with two processes
    done = _run("slideformer", tmp_path / "ours.pt", "--clip", "0.05", "--halve-grads")
    assert done.returncode != 0
    said = re.search(r"A hook changed the gradient of 'model\.model\.[\w.]+' in place", done.stderr)
    assert said, done.stderr[-3000:]


@pytest.mark.slow
def test_the_processes_of_a_node_plan_on_their_share_of_its_ram(tmp_path):
    # 100 MiB free: one process fits (it needs ~60 MiB), two each planning on all of it would not
    assert _run("slideformer", tmp_path / "one.pt", "--host-mib", "100", "--devices", "1").returncode == 0
    done = _run("slideformer", tmp_path / "two.pt", "--host-mib", "100", "--devices", "2")
    assert done.returncode != 0
    assert "more host memory but only 0.05 GiB is available" in done.stderr


@pytest.mark.parametrize("devices", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_the_processes_of_a_node_hold_the_state_once_and_each_updates_its_share(tmp_path, devices):
    # AdamW (two groups, tied embeddings) with clipping: masters, moments and the retained gradients in the memory
    # the node's processes share; each process updates its rows of every parameter
    options = ["--devices", str(devices), "--clip", "0.05"]
    ours = _trained("slideformer", tmp_path / "ours.pt", *options, "--report", str(tmp_path / "report"))
    ddp = _trained("ddp", tmp_path / "ddp.pt", *options)
    err, where = max_rel_error(ours, ddp)
    assert err < 1e-5, f"{where}: {err:.2e}"
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in range(devices)]
    assert all(r["inodes"] == reports[0]["inodes"] and r["inodes"] for r in reports)  # the same memory
    assert all(r["private"] == 0 and r["shared"] > 0 for r in reports)  # every parameter and state tensor in it
    # masters, two moments and the retained gradients of the model's parameters, once (each mapping whole pages), as
    # training ends (the teardown lets the retained gradients go)
    numel = sum(v.numel() for k, v in ours.items() if k != "model.lm_head.weight")  # tied to the embedding
    assert 16 * numel <= reports[0]["bytes"] <= 16 * numel + 4096 * len(reports[0]["inodes"])
    # the model's weights once too: the others dropped what they loaded before the plan (one element per parameter)
    assert reports[0]["held_at_plan"] >= 4 * numel
    assert all(r["held_at_plan"] <= 4 * len(ours) for r in reports[1:])
    _every_process_holds_the_trained_weights(tmp_path, devices)
    # 4 steps of every parameter, split among the processes by rows
    updated = [r["updated"] for r in reports]
    assert sum(updated) == 4 * numel
    assert max(updated) - min(updated) <= 0.05 * sum(updated)
