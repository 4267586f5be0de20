"""Memory benchmark (GPU machine): the model sizes the NVMe tier and activation offload are for, trained with
``CausalLMModule`` (random init from a config) through ``Trainer(strategy=SlideFormerStrategy(...))`` in
bf16-mixed, the GPU capped at --gpu-cap-gib.

Cases (one per process, so each host peak is its own):
  8b         Llama-3.1-8B shape, full fine-tune, optimizer state in RAM, 32k tokens/step (8 x 4096; activation
             offload left on "auto": the 32 blocks' inputs, 16 GiB, do not fit the cap beside the work)
  8b-64k     the same model on one 64k-token sequence with activation offload (and, as the engine decides, tiled MLPs)
  3b-nvme    Llama-3.2-3B shape, full fine-tune, Adam state on NVMe under --nvme-path, 32k tokens/step; dd's
             O_DIRECT write and read bandwidth on the same disk, measured in the same run
  3b-nvme-masters  the same, with the blocks' fp32 masters on NVMe too (nvme_masters=True): the blocks' weight
             matrices are built in bf16 and live in RAM only as bf16
  32b-lora   Qwen2.5-32B shape, LoRA r=16 on the attention projections, the base built in bf16 (~62 GiB in RAM),
             8k tokens/step

Weights are random (``fast_random_init``). Reports tokens/s (median step), peak GPU memory (allocated, reserved),
peak host RSS (VmHWM) and bytes per parameter, and for NVMe the disk bytes the process read and wrote per step
(/proc/self/io) over the step time. Appends CSV rows to --out.

    python benchmarks/bench_memory.py --case 8b --out benchmarks/results/memory.csv
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time
import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from bench_core import GIB, cap_gpu, peak_rss, reset_peak_rss
from bench_nvme_io import dd

from results_csv import append_row, environment

LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip
LLAMA_3B = dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
QWEN_32B = dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768,
                rope_theta=1000000.0, tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip


def io_bytes() -> tuple[int, int]:
    """Bytes this process read from and wrote to storage (O_DIRECT included)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def train(module, strategy, batch: int, seq: int, steps: int, warmup: int, cap_gib: float, clip: float | None) -> dict:
    """Fit ``module`` for warmup + steps on random tokens; the median step's figures."""
    import lightning as L
    from torch.utils.data import DataLoader

    cap_gpu(cap_gib)
    marks, offloaded = [], []

    class Clock(L.Callback):
        def on_train_batch_end(self, *args):
            torch.cuda.synchronize()
            marks.append((time.perf_counter(), *io_bytes()))
            print(f"step {len(marks)} ended at {marks[-1][0] - start:.1f} s", flush=True)  # progress, if killed

        def on_train_end(self, trainer, *args):  # before the strategy's teardown
            engine = trainer.strategy.engine
            engine.wait()  # updates in flight hold landing buffers
            pool = engine.activations._free.values() if engine.activations is not None else []
            offloaded.append({
                "activations_offloaded": engine.offload.blocks, "mlp_tiled": engine.offload.tiling,
                "offload_pool_gib": sum(raw.numel() for buffers in pool for raw, _ in buffers) / GIB,
                "landing_gib": engine.transfer._landing.qsize() * engine.transfer.chunk_numel * 4 / GIB,
                "host_train_peak_gib": peak_rss() / GIB,  # host_peak_gib also spans the teardown
            })  # fmt: skip

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128256, (warmup + steps, batch, seq), generator=g)
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    start = time.perf_counter()
    trainer = L.Trainer(
        strategy=strategy, precision="bf16-mixed", max_steps=warmup + steps, gradient_clip_val=clip, logger=False,
        callbacks=[Clock()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=None))
    steps_ = [(b[0] - a[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(marks[warmup - 1 :], marks[warmup:])]
    step_s, read, written = sorted(steps_)[len(steps_) // 2]
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {
        **offloaded[0], "step_s": step_s, "tok_s": batch * seq / step_s,
        "first_step_s": marks[0][0] - start,
        "gpu_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / GIB, "host_peak_gib": peak_rss() / GIB,
        "disk_read_gb_per_step": read / 1e9, "disk_write_gb_per_step": written / 1e9,
        "disk_gb_s": (read + written) / 1e9 / step_s,
    }  # fmt: skip


@contextmanager
def fast_random_init(tile_numel: int = 1 << 24):
    """Random weights without drawing billions of numbers one by one (torch's CPU ``normal_`` and ``uniform_`` run
    nearly serially: the 32B build took over 200 s on the H200 machine's 16 cores). Inside, ``normal_`` and
    ``uniform_`` (``nn.Linear``'s own init, then Hugging Face's) fill a CPU tensor with copies of one random tile,
    scaled and shifted: values of the right distribution, not independent ones, which a speed and memory benchmark
    does not need."""
    g = torch.Generator().manual_seed(0)
    tiles = {"normal_": torch.randn(tile_numel, generator=g), "uniform_": torch.rand(tile_numel, generator=g)}
    originals = {name: getattr(torch.Tensor, name) for name in tiles}

    def filler(name: str, scale_shift):
        def fill(self, a=0.0, b=1.0, *, generator=None):
            if self.device.type != "cpu" or not self.is_contiguous():
                return originals[name](self, a, b, generator=generator)
            flat = self.view(-1)
            for start in range(0, flat.numel(), tile_numel):
                piece = flat[start : start + tile_numel]
                piece.copy_(tiles[name][: piece.numel()])
            scale, shift = scale_shift(a, b)
            return self.mul_(scale).add_(shift)

        return fill

    torch.Tensor.normal_ = filler("normal_", lambda mean, std: (std, mean))
    torch.Tensor.uniform_ = filler("uniform_", lambda low, high: (high - low, low))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def print_live_allocations(top: int = 12) -> None:
    """After a CUDA OOM: the live allocations grouped by the innermost line of our code (or transformers') that
    made them (recorded when --memory-history is on)."""
    by_origin: Counter[str] = Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if "lightning_slide" in f["filename"] or
                      "transformers" in f["filename"] or "kernels" in f["filename"]]  # fmt: skip
            where = f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"
            by_origin[where] += block["size"]
    print("live GPU allocations at the OOM, by origin:")
    for where, size in by_origin.most_common(top):
        print(f"  {size / GIB:7.2f} GiB  {where}")


def dd_bandwidth(directory: str, gib: int = 4) -> str:
    """dd's O_DIRECT write then read of a ``gib`` GiB file in ``directory`` (the disk's reference figure)."""
    path = os.path.join(directory, "dd.bin")
    try:
        written, read = dd(path, regions=gib * 128, size=8 << 20)
    finally:
        os.remove(path)
    return f"dd direct, 8 MiB blocks: write {written:.2f} GB/s, read {read:.2f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["8b", "8b-64k", "3b-nvme", "3b-nvme-masters", "32b-lora"], required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gpu-cap-gib", type=float, default=24.0)
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--long-seq", type=int, default=65536, help="8b-64k: the sequence length")
    parser.add_argument("--nvme-path", default="slide-nvme")
    parser.add_argument("--out", default="benchmarks/results/memory.csv")
    parser.add_argument("--memory-history", action="store_true", help="record allocation stacks (for OOM reports)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)9.0f ms %(name)s: %(message)s")
    logging.getLogger("lightning_slide").setLevel(logging.INFO)  # the plan and the automatic choices
    if args.memory_history:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1)

    import lightning
    import transformers

    from lightning_slide import CausalLMModule, LoRA, SlideFormerStrategy

    common = {**environment(), "lightning": lightning.__version__, "transformers": transformers.__version__}

    def record(name: str, batch: int, seq: int, module, strategy, note: str = "") -> None:
        try:
            with fast_random_init():
                result = train(module, strategy, batch, seq, args.steps, args.warmup, args.gpu_cap_gib, args.clip)
        except Exception as err:  # keep what was measured; say what failed
            traceback.print_exc()
            if isinstance(err, torch.OutOfMemoryError):
                print_live_allocations()
            torch.cuda.set_per_process_memory_fraction(1.0)
            result = {"step_s": float("nan"), "note": f"FAILED: {type(err).__name__}: {str(err)[:300]}"}
        finally:
            module._trainer = None  # it holds the optimizer and its state: the next run starts without them
            gc.collect()  # the trainer's reference cycles
        params = sum(p.numel() for p in module.parameters())
        row = {**common, "case": name, "clip": args.clip or "none", "params": params, "batch": batch, "seq": seq,
               "note": note, **result}  # fmt: skip
        if "host_peak_gib" in row:
            row["host_b_per_param"] = row["host_peak_gib"] * GIB / params
            if "full" in name:
                row["host_target_b_per_param"] = (5 if "nvme" in name.lower() else 13) + 2 * GIB / params
        append_row(args.out, row)

    if args.case == "8b":
        module = CausalLMModule(config=LLAMA_8B, lr=1e-5)
        record("llama3.1-8b full, state in RAM", 8, 4096, module, SlideFormerStrategy())  # activations: "auto"
    elif args.case == "8b-64k":
        module = CausalLMModule(config=LLAMA_8B, lr=1e-5)
        strategy = SlideFormerStrategy(offload_activations=True)
        record("llama3.1-8b full, 64k sequence, activation offload", 1, args.long_seq, module, strategy)
    elif args.case == "32b-lora":
        module = CausalLMModule(config=QWEN_32B, lora=LoRA(r=16, alpha=32), lr=1e-4)
        record("qwen2.5-32b lora r=16, bf16 base", 2, 4096, module, SlideFormerStrategy())
    else:
        os.makedirs(args.nvme_path, exist_ok=True)
        reference = dd_bandwidth(args.nvme_path)
        masters = args.case == "3b-nvme-masters"
        module = CausalLMModule(config=dict(LLAMA_3B, dtype="bfloat16") if masters else LLAMA_3B, lr=1e-5)
        strategy = SlideFormerStrategy(optimizer_offload="nvme", nvme_path=args.nvme_path, nvme_masters=masters)
        name = f"llama3.2-3b full, Adam state{' and block masters' if masters else ''} on NVMe"
        record(name, 8, 4096, module, strategy, note=reference)  # activations: "auto"


if __name__ == "__main__":
    main()
