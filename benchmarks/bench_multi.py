"""Several GPUs (GPU machine): the module a user writes, trained data parallel on 1, 2 and 4 GPUs of one host.

Systems, every run a fresh process with no environment variables set:

- ``slideformer``: Lightning's ``Trainer(devices=N)`` with ``SlideFormerStrategy(device_memory_gib=--gpu-cap-gib)``
  (each GPU capped);
- ``fsdp2_offload``: FSDP2 ``fully_shard`` per block with ``CPUOffloadPolicy(pin_memory=True)`` and bf16 compute, in a
  loop of its own (uncapped; Lightning's ``ModelParallelStrategy`` moves the module to the GPU, which CPU offload does
  not allow);
- ``ddp``: ``Trainer(devices=N, strategy="ddp")``, everything on each GPU (uncapped; an out-of-memory error is
  recorded as such).

The model is the 2.8 B Llama shape of ``bench_core.py`` (``--layers``), bf16-mixed, AdamW, ``--batch`` sequences of
``--seq`` tokens per GPU. Reports global tokens/s (median step), the peak GPU memory of the first process, and the
host's memory per parameter: the peak of the machine's used memory (MemTotal - MemAvailable, shared memory
included) over the timed steps, less what was used before the run started. Appends CSV rows to --out.

    python benchmarks/bench_multi.py --gpus 1,2,4 --out benchmarks/results/multi.csv
    python benchmarks/bench_multi.py --gpus 1,2,4 --layers 32 --batch 8 --clip 1.0   # the 8B shape, 32k per GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from results_csv import append_row, environment

SYSTEMS = ("slideformer", "fsdp2_offload", "ddp")
FIELDS = ("params", "step_s", "tok_s", "gpu_alloc_gib", "host_bytes_per_param", "error")


def used_bytes() -> int:
    """The machine's memory in use (MemTotal - MemAvailable)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":")
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def fsdp2_child(
    rank: int, gpus: int, layers: int, batch: int, seq: int, steps: int, warmup: int, clip: float | None, port: int, out
) -> None:
    """One process of FSDP2 with CPU offload, as its documentation sets it up (Lightning's ModelParallelStrategy
    moves the module to the GPU after ``configure_model``, which CPU offload does not allow)."""
    import torch.distributed as dist
    from bench_core import fsdp2_offloaded, param_count

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=gpus)
    torch.manual_seed(0)
    model = fsdp2_offloaded(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)  # torch's fastest on CPU
    g = torch.Generator().manual_seed(rank)
    used: list[int] = []
    ends = []
    for i in range(warmup + steps):
        if i == warmup and rank == 0:
            threading.Thread(target=_sample, args=(used,), daemon=True).start()
        ids = torch.randint(0, 128256, (batch, seq), generator=g).cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:  # as clip_grad_norm_, over the offloaded (CPU) shards: their squares summed over NCCL
            grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
            total = torch.stack([g.float().square().sum() for g in grads]).sum().cuda()
            dist.all_reduce(total)
            torch._foreach_mul_(grads, (clip / (total.sqrt() + 1e-6)).clamp(max=1.0).cpu())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    if rank == 0:
        out.put(_result(ends, warmup, gpus, batch, seq, param_count(layers), used))
    dist.destroy_process_group()


def _sample(used: list[int]) -> None:
    while True:
        used.append(used_bytes())
        time.sleep(0.1)


def _result(ends, warmup, gpus, batch, seq, params, used) -> dict:
    step = statistics.median(b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:]))
    gpu = torch.cuda.max_memory_allocated() / 2**30
    return {"params": params, "step_s": step, "tok_s": gpus * batch * seq / step, "gpu_alloc_gib": gpu,
            "host_peak_used": max(used, default=0)}  # fmt: skip


def child(
    system: str, gpus: int, layers: int, batch: int, seq: int, steps: int, warmup: int, clip: float | None, cap: float
) -> None:
    """One run: Lightning's launcher starts the other processes by running this again; the first prints the result."""
    import lightning as L
    from bench_core import llama_config, param_count
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    import lightning_slide

    class LM(L.LightningModule):  # the README's module
        def __init__(self):
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(llama_config(layers))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.1)

    ends: list[float] = []
    used: list[int] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if len(ends) == warmup and trainer.is_global_zero:  # the timed steps: the host's memory sampled
                threading.Thread(target=_sample, args=(used,), daemon=True).start()

    torch.manual_seed(0)
    if system == "slideformer":
        module, strategy = LM(), lightning_slide.SlideFormerStrategy(device_memory_gib=cap)
    else:
        module, strategy = LM(), "ddp"
        module.model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128256, (batch, seq), generator=g) for _ in range((warmup + steps) * gpus)]
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu", devices=gpus, precision="bf16-mixed", max_steps=warmup + steps,
        gradient_clip_val=clip, callbacks=[Clock()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=None))
    if trainer.is_global_zero:
        print(json.dumps(_result(ends, warmup, gpus, batch, seq, param_count(layers), used)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--gpus", default="1,2,4", help="world sizes, comma-separated (those the machine has run)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clip", type=float, default=None, help="gradient clipping by norm (SlideFormer: 'forward')")
    parser.add_argument("--gpu-cap-gib", type=float, default=24.0)
    parser.add_argument("--out", default="benchmarks/results/multi.csv")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [args.layers, args.batch, args.seq, args.steps, args.warmup, args.clip]
    if args.child:
        system, gpus = args.child.split(":")
        if system == "fsdp2_offload":
            out = torch.multiprocessing.get_context("spawn").SimpleQueue()
            torch.multiprocessing.spawn(fsdp2_child, (int(gpus), *sizes, 29533, out), nprocs=int(gpus))
            print(json.dumps(out.get()))
        else:
            child(system, int(gpus), *sizes, args.gpu_cap_gib)
        return
    env = environment()
    import lightning
    import transformers

    env.update(lightning=lightning.__version__, transformers=transformers.__version__)
    for gpus in [int(n) for n in args.gpus.split(",") if int(n) <= torch.cuda.device_count()]:
        for system in args.systems.split(","):
            before = used_bytes()
            options = ["--layers", "--batch", "--seq", "--steps", "--warmup", "--clip"]
            command = [sys.executable, __file__, "--child", f"{system}:{gpus}", "--gpu-cap-gib", str(args.gpu_cap_gib)]
            command += [str(x) for pair in zip(options, sizes) if pair[1] is not None for x in pair]
            done = subprocess.run(command, capture_output=True, text=True)
            row = {**env, "model": f"llama-4096x{args.layers}-v128256", "system": system, "gpus": gpus,
                   "tokens_per_gpu": args.batch * args.seq, "clip": args.clip or "", **dict.fromkeys(FIELDS, ""),
                   "gpu_cap_gib": args.gpu_cap_gib if system == "slideformer" else ""}  # fmt: skip
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr, flush=True)
                append_row(args.out, {**row, "error": done.stderr.strip().splitlines()[-1][:300]})
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            host = result.pop("host_peak_used") - before
            append_row(args.out, {**row, **result, "host_bytes_per_param": host / result["params"]})


if __name__ == "__main__":
    main()
