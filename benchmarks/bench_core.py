"""Core benchmark (GPU machine): one training step of a Llama-shape model, four ways, in one run.

(a) SlideFormer through ``Trainer(strategy="slideformer")`` with the module a user writes
    (``self.model(input_ids=ids, labels=ids).loss``), GPU capped at --gpu-cap-gib, schedule "backward"
    (no clipping) and "forward" (``gradient_clip_val=1.0``); ``--schedules`` may add "norm-first" (clipping at 1.0
    with two backward passes) and "auto" (no clipping, the schedule the strategy picks);
(b) everything on the GPU: fp32 masters, bf16 autocast, fused AdamW, Hugging Face recompute (uncapped);
(c) FSDP2 ``fully_shard`` per block with ``CPUOffloadPolicy(pin_memory=True)`` and a bf16 MixedPrecisionPolicy on
    a world of one (uncapped);
(d) the floor: torch's fused CPU AdamW over all parameters, timed alone;
(e) (with --systems e) the same AdamW while the copy engines move a step's worth of bytes between pinned host
    memory and the GPU, both ways (--copy-gb): the host-memory floor of any step that keeps the fp32 masters and
    moments in RAM and moves its weights up and its gradients down every step. Also times the copies alone.

Reports tokens/s (median step), peak GPU memory (allocated and reserved), peak host RSS of the process during
that system's run (VmHWM, reset in between; after fit included, where Lightning's teardown brings every optimizer
state to the host), host bytes per parameter, and for (a) a per-step timeline (CPU worker busy, the training thread's
waits, bytes moved, the host's peak before the profiled step, whose profiler takes host memory of its own, and as
training ends; then one extra, untimed step under torch's profiler: GPU time in kernels and in copies each
way, and the CPU worker's idle gaps in that step against the training thread's forward and backward). Appends CSV
rows to --out.

    python benchmarks/bench_core.py --out benchmarks/results/core.csv
    python benchmarks/bench_core.py --systems a --engine split_embedding_update=False   # (a) with an EngineConfig field
    python benchmarks/bench_core.py --systems a --engine rows_pass_numel=8388608
"""

from __future__ import annotations

import argparse
import gc
import gzip
import logging
import os
import statistics
import time

import torch

from results_csv import append_row, environment

GIB = 2**30


def llama_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
    )  # fmt: skip


def param_count(layers: int) -> int:
    c = llama_config(layers)
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    block = 2 * c.hidden_size * (c.hidden_size + kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return layers * block + 2 * c.vocab_size * c.hidden_size + c.hidden_size


def make_model(layers: int):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(llama_config(layers))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM (Linux >= 4.0)
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def start_measure() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    # Pinned memory freed by an earlier run stays cached (and resident) unless released; release it so each
    # system's host peak is its own.
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        if hasattr(torch._C, name):
            getattr(torch._C, name)()
            break
    torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()


def cap_gpu(cap_gib: float) -> None:
    """Limit this process's GPU memory to ``cap_gib`` (``torch.cuda.set_per_process_memory_fraction``)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total))


def gpu_peaks() -> tuple[float, float]:
    return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


IDS = "uniform"  # token ids: "uniform" over the vocabulary, or "zipf" (--ids)


def batches(n: int, batch: int, seq: int, vocab: int = 128256):
    g = torch.Generator().manual_seed(0)
    if IDS == "uniform":
        return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]
    # Zipf's law over ranks (exponent 1.1, as text roughly follows), ranks scattered over the ids: a batch touches
    # far fewer embedding rows than uniform ids do (those touch 22 % of the rows at 32k tokens)
    weights = torch.arange(1, vocab + 1, dtype=torch.float64) ** -1.1
    rank_to_id = torch.randperm(vocab, generator=g)
    return [rank_to_id[torch.multinomial(weights, batch * seq, True, generator=g)].view(batch, seq) for _ in range(n)]


# ---- (a) SlideFormer ---------------------------------------------------------------------------------------------


def run_slideformer(
    module,
    schedule: str,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    cap_gib: float,
    threads,
    trace_dir: str | None = None,
    config=None,
    accumulate: int = 1,
    strategy_args=None,
):
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_slide

    cap_gpu(cap_gib)
    times, timeline, profiled = [], [], []
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if trace_dir else [])
    profiler = torch.profiler.profile(activities=activities)
    marks: dict[str, float] = {}  # the profiled step's phases on the training thread (perf_counter)
    untraced_peak: list[int] = []  # the host's peak before that step: the profiler's own buffers take host memory
    # and as training ends: after it, Lightning's teardown brings the optimizer state of what the GPU held to the host
    trained_peak: list[int] = []
    deferred: list[tuple[int, int, int]] = []  # blocks updated during the next forward, a step late; dead ends

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            # one more step, not timed: where the GPU's and the worker's time goes
            if batch_idx == (warmup + steps) * accumulate:
                trainer.strategy.engine.worker.timeline = []
                untraced_peak.append(peak_rss())
                marks["start"] = time.perf_counter()
                profiler.start()

        def on_train_end(self, trainer, module):
            trained_peak.append(peak_rss())
            engine = trainer.strategy.engine
            dead = getattr(engine, "dead_ends", None)  # (older engines: none)
            dead = sum(map(len, dead.layers.values())) if dead is not None else 0
            kept = getattr(engine, "kept_attention", None)
            kept = sum(kept.keeps.values()) if kept is not None else 0
            deferred.append((len(engine.deferred), len(engine.delayed), dead, kept) if engine is not None else
                            (0, 0, 0, 0))  # fmt: skip

        def on_fit_start(self, trainer, module):
            # The end of backward is marked by wrapping the module's backward, not in on_after_backward: a hook that
            # may read param.grad makes the strategy keep fp32 gradients ("forward" would then not be the user's).
            backward = module.backward

            def marked_backward(*args, **kwargs):
                backward(*args, **kwargs)
                if "start" in marks:
                    marks["backward_done"] = time.perf_counter()

            module.backward = marked_backward

        def on_before_backward(self, trainer, module, loss):
            if "start" in marks:
                marks["forward_done"] = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate:  # an optimizer step ends with its last micro-batch
                return
            torch.cuda.synchronize()
            if batch_idx + 1 == (warmup + steps + 1) * accumulate:
                profiler.stop()
                marks["end"] = time.perf_counter()
                worker = trainer.strategy.engine.worker
                profiled.append(gpu_time_by_kind(profiler) + "; " + worker_in_step(worker.timeline, marks))
                worker.timeline = None
                if trace_dir:
                    write_trace(profiler, os.path.join(trace_dir, f"a_{schedule}_{batch.numel()}.json"))
                return
            engine = trainer.strategy.engine
            stats = engine.window.stats
            times.append(time.perf_counter())
            timeline.append(
                (engine.worker.busy_s, engine.worker.wait_s, stats.wait_update_s, stats.wait_send_s,
                 stats.upload_bytes + getattr(engine.sender, "upload_bytes", 0),  # (older engines: none)
                 engine.sender.download_bytes)
            )  # fmt: skip

    start_measure()
    trainer = L.Trainer(
        strategy=lightning_slide.SlideFormerStrategy(  # --strategy update_schedule=... overrides the schedule's
            **{"cpu_threads": threads, "update_schedule": schedule, "engine": config, **(strategy_args or {})}
        ),
        precision="bf16-mixed",
        max_steps=warmup + steps + 1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=None if schedule in ("backward", "auto") else 1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Clock()],
    )  # fmt: skip
    data = DataLoader(batches((warmup + steps + 1) * accumulate, batch, seq), batch_size=None)
    trainer.fit(module, data)
    torch.cuda.synchronize()
    module._trainer = None  # the trainer holds the optimizer and its state: the next run starts without them
    del module.backward  # Clock's wrapper
    step_times = [b - a for a, b in zip(times[warmup - 1 :], times[warmup:])]
    deltas = [[b - a for a, b in zip(t0, t1)] for t0, t1 in zip(timeline[warmup - 1 :], timeline[warmup:])]
    mid = sorted(range(len(step_times)), key=step_times.__getitem__)[len(step_times) // 2]
    alloc, reserved = gpu_peaks()
    torch.cuda.set_per_process_memory_fraction(1.0)
    busy, worker_wait, wait_update, wait_send, up, down = deltas[mid]
    return {
        "step_s": step_times[mid], "gpu_alloc_gib": alloc, "gpu_reserved_gib": reserved, "host_peak": peak_rss(),
        "timeline": f"cpu_worker_busy={busy:.3f}s cpu_worker_waits_gpu={worker_wait:.3f}s"
                    f" train_thread_waits_update={wait_update:.3f}s train_thread_waits_send={wait_send:.3f}s"
                    f" upload={up / 1e9:.1f}GB download={down / 1e9:.1f}GB"
                    f" host_peak_before_the_profiled_step={untraced_peak[0] / GIB:.2f}GiB"
                    f" host_peak_as_training_ends={trained_peak[0] / GIB:.2f}GiB deferred_blocks={deferred[0][0]}"
                    f" delayed_blocks={deferred[0][1]} dead_end_layers={deferred[0][2]}"
                    f" kept_attention_blocks={deferred[0][3]};"
                    f" one more step profiled: {profiled[0]}",
    }  # fmt: skip


def write_trace(profiler, path: str) -> None:
    """The profiled step as a gzipped Chrome trace at ``path`` + ".gz" (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profiler.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
        z.write(f.read())
    os.remove(path)


def gpu_time_by_kind(profiler) -> str:
    """GPU time of the profiled step by kind: kernels, host-to-device and device-to-host copies, each summed over
    streams (they overlap, so the sum can exceed the step), and the span from the first to the last."""
    try:
        events = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        totals = {"kernels": 0.0, "h2d": 0.0, "d2h": 0.0}
        computing = []
        for e in events:
            kind = "h2d" if "HtoD" in e.name else "d2h" if "DtoH" in e.name else "kernels"
            totals[kind] += e.time_range.elapsed_us() / 1e6
            if kind == "kernels":
                computing.append((e.time_range.start, e.time_range.end))
        span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e6
        busy = _union_s(computing)
        return (" ".join(f"gpu_{k}={v:.3f}s" for k, v in totals.items()) + f" gpu_span={span:.3f}s"
                f" gpu_computing={busy:.3f}s")  # fmt: skip
    except Exception as err:  # the figures above stand without it
        return f"profile failed: {type(err).__name__}: {err}"


def worker_in_step(tasks: list[tuple[str, float, float, float]], marks: dict[str, float], min_gap_s=0.002) -> str:
    """The profiled step on the CPU worker, in ms from the step's start: when the training thread was done with the
    forward and the backward, the worker's time running tasks and waiting for their copies, and where it sat idle
    (no task taken up) for over ``min_gap_s``, each gap with the task that ended it."""
    t0, t1 = marks["start"], marks["end"]

    def ms(t: float) -> str:
        return f"{(t - t0) * 1e3:.1f}"

    in_step = [task for task in tasks if task[3] > t0 and task[1] < t1]
    inside = [(name, max(taken, t0), max(start, t0), min(end, t1)) for name, taken, start, end in in_step]
    busy = sum(end - start for _, _, start, end in inside if end > start)
    waiting = sum(start - taken for _, taken, start, _ in inside if start > taken)
    gaps, free_from = [], t0
    for name, taken, _, end in sorted(inside, key=lambda task: task[1]):
        if taken - free_from > min_gap_s:
            gaps.append(f"{ms(free_from)}-{ms(taken)} then {name}")
        free_from = max(free_from, end)
    if t1 - free_from > min_gap_s:
        gaps.append(f"{ms(free_from)}-{ms(t1)} to the end")
    phases = " ".join(f"{k}={ms(v)}" for k, v in marks.items() if k != "start")
    by_task: dict[str, list[float]] = {}
    for name, taken, start, end in inside:
        spent = by_task.setdefault(name, [0, 0.0, 0.0])
        spent[0] += 1
        spent[1] += max(0.0, start - taken) * 1e3
        spent[2] += max(0.0, end - start) * 1e3
    tasks_text = " ".join(f"{name}:n={n},wait={w:.1f},busy={b:.1f}" for name, (n, w, b) in by_task.items())
    waits = [f"{name}@{ms(taken)}+{(start - taken) * 1e3:.1f}" for name, taken, start, _ in inside
             if start - taken > min_gap_s]  # fmt: skip
    return (
        f"worker (ms from the step's start; {phases}): busy={busy * 1e3:.1f} waiting_for_copies={waiting * 1e3:.1f}"
        f" idle_over_{min_gap_s * 1e3:.0f}ms=[{', '.join(gaps[:12])}{', ...' if len(gaps) > 12 else ''}]"
        f" waits_over_{min_gap_s * 1e3:.0f}ms=[{', '.join(waits[:16])}{', ...' if len(waits) > 16 else ''}]"
        f" by_task=[{tasks_text}]"
    )


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds: when the GPU computed at all."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total / 1e6


class BenchLM:
    """Built lazily so that Lightning is imported only when (a) runs."""

    @staticmethod
    def create(layers: int):
        import lightning as L

        class _LM(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = make_model(layers)

            def training_step(self, batch, batch_idx):
                return self.model(input_ids=batch, labels=batch).loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.01)

        return _LM()


# ---- (b) all on the GPU, (c) FSDP2 CPU offload -------------------------------------------------------------------


def run_plain(
    model, batch: int, seq: int, steps: int, warmup: int, fused: bool = True, trace: str | None = None,
    accumulate: int = 1,
):  # fmt: skip
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-5, weight_decay=0.01, fused=fused, foreach=None if fused else True
    )
    micro = [b.cuda() for b in batches((warmup + steps) * accumulate, batch, seq)]
    data = [micro[i : i + accumulate] for i in range(0, len(micro), accumulate)]
    times = []

    def step(micro_batches):
        for ids in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / accumulate).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    for i, ids in enumerate(data):
        if i == warmup:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(ids)
        times.append(time.perf_counter() - start)
    alloc, reserved = gpu_peaks()
    if trace:  # one more step, not timed, under the profiler (compare its kernels with (a)'s: trace_kernels.py)
        activities = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profiler:
            step(data[-1])
        write_trace(profiler, trace)
    return {"step_s": statistics.median(times[warmup:]), "gpu_alloc_gib": alloc, "gpu_reserved_gib": reserved,
            "host_peak": peak_rss(), "timeline": ""}  # fmt: skip


def run_all_gpu(layers, batch, seq, steps, warmup, trace_dir=None, accumulate=1):
    start_measure()
    model = make_model(layers).cuda()
    trace = os.path.join(trace_dir, f"b_all_gpu_{batch * seq}.json") if trace_dir else None
    out = run_plain(model, batch, seq, steps, warmup, trace=trace, accumulate=accumulate)
    del model
    return out


def fsdp2_offloaded(layers: int):
    """The model under FSDP2: ``fully_shard`` per block and at the root, CPU offload, bf16 compute, HF recompute."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = make_model(layers)
    model.gradient_checkpointing_enable()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def run_fsdp2(layers, batch, seq, steps, warmup):
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    start_measure()
    model = fsdp2_offloaded(layers)
    try:
        out = run_plain(model, batch, seq, steps, warmup, fused=True)
    except RuntimeError as err:  # fused CPU AdamW on DTensor shards may be missing: the foreach kernel then
        out = run_plain(model, batch, seq, steps, warmup, fused=False)
        out["timeline"] = f"foreach AdamW (fused failed: {str(err)[:80]})"
    del model
    return out


# ---- (d) the CPU AdamW floor ---------------------------------------------------------------------------------------


def floor_optimizer(layers: int) -> torch.optim.AdamW:
    """Fused CPU AdamW over a fresh model's parameters, each with a random gradient."""
    start_measure()
    params = list(make_model(layers).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)


def run_floor(layers: int, threads: int, repeats: int = 3):
    opt = floor_optimizer(layers)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    del opt
    return {"step_s": statistics.median(times[1:]), "gpu_alloc_gib": 0.0, "gpu_reserved_gib": 0.0,
            "host_peak": peak_rss(), "timeline": f"threads={threads}"}  # fmt: skip


def run_floor_with_copies(layers: int, threads: int, up_gb: float, down_gb: float, repeats: int = 3):
    # (e): AdamW's DRAM traffic and the copy engines' share the host's memory bandwidth (DESIGN.md); both ways at
    # once, in 256 MiB copies from and into 1 GiB pinned buffers (larger than any cache)
    opt = floor_optimizer(layers)
    chunk = 256 * 2**20
    host_up = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    host_down = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev_up = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dev_down = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def copies(src: torch.Tensor, dst: torch.Tensor, total_gb: float, stream) -> None:
        with torch.cuda.stream(stream):
            for i in range(round(total_gb * 1e9 / chunk)):
                lo = (i * chunk) % GIB
                dst[lo : lo + chunk].copy_(src[lo : lo + chunk], non_blocking=True)

    def step(adam: bool, transfers: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        if transfers:
            copies(host_up, dev_up, up_gb, streams[0])
            copies(dev_down, host_down, down_gb, streams[1])
        if adam:
            opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    step(True, True)  # warm-up
    timed = {"adam_with_copies": [], "adam": [], "copies": []}
    for _ in range(repeats):  # interleaved
        timed["adam_with_copies"].append(step(True, True))
        timed["adam"].append(step(True, False))
        timed["copies"].append(step(False, True))
    torch.set_num_threads(before)
    median = {k: statistics.median(v) for k, v in timed.items()}
    return {"step_s": median["adam_with_copies"], "gpu_alloc_gib": 0.0, "gpu_reserved_gib": 0.0,
            "host_peak": peak_rss(), "timeline": f"threads={threads} up={up_gb}GB down={down_gb}GB "
            f"adam_alone={median['adam']:.3f}s copies_alone={median['copies']:.3f}s"}  # fmt: skip


def settings(items: list[str]) -> tuple[dict, str]:
    """``NAME=VALUE`` settings as keyword arguments (VALUE: True, False, None, a number or a word), and a suffix for
    the system's name (empty without settings)."""
    words = {"True": True, "False": False, "None": None}
    values = {}
    for item in items:
        name, _, text = item.partition("=")
        try:
            values[name] = words[text] if text in words else float(text) if "." in text else int(text)
        except ValueError:
            values[name] = text
    return values, "".join(f"[{item}]" for item in items)


def engine_config(items: list[str]):
    """An ``EngineConfig`` with ``FIELD=VALUE`` settings (VALUE: True, False, auto, or an int), and a suffix for the
    system's name."""
    import dataclasses

    from lightning_slide.engine import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    values, suffix = settings(items)
    if unknown := sorted(set(values) - fields):
        known = ", ".join(sorted(fields))
        raise SystemExit(f"--engine: EngineConfig has no field {', '.join(unknown)} (fields: {known})")
    return EngineConfig(**values), suffix


def main() -> None:
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("lightning_slide").setLevel(logging.INFO)  # the engine's choices: split, offload, plan
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tokens", default="8192,32768", help="tokens per micro-batch (comma-separated)")
    parser.add_argument("--accumulate", type=int, default=1, help="(a), (b): micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", default="d,a,b,c")
    parser.add_argument("--schedules", default="backward,forward", help="update schedules of (a)")
    parser.add_argument("--gpu-cap-gib", type=float, default=24.0)
    parser.add_argument("--ids", choices=["uniform", "zipf"], default="uniform", help="token id distribution")
    parser.add_argument("--cpu-threads", type=int, default=None, help="(a): threads of the CPU optimizer")
    parser.add_argument("--main-threads", type=int, default=None, help="(a): torch threads of the training thread")
    parser.add_argument(
        "--copy-gb",
        default="13.4,11.2",
        help="(e): GB up,down per step (default: what (a)'s timeline reports at 8k tokens)",
    )
    parser.add_argument("--out", default="benchmarks/results/core.csv")
    parser.add_argument("--trace-dir", default=None, help="(a), (b): write a profiled step's trace here")
    parser.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                        help="(a): a field of lightning_slide.engine.EngineConfig (e.g. split_embedding_update=False,"
                             " rows_pass_numel=8388608), to compare a choice side by side")  # fmt: skip
    parser.add_argument(
        "--strategy",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="(a): an argument of SlideFormerStrategy (e.g. offload_activations=True)",
    )
    args = parser.parse_args()
    config, engine_settings = engine_config(args.engine)
    extra, strategy_settings = settings(args.strategy)
    global IDS
    IDS = args.ids

    import lightning
    import transformers

    n_params = param_count(args.layers)
    common = {
        **environment(), "lightning": lightning.__version__, "transformers": transformers.__version__,
        "model": f"llama-{args.layers}x4096-v128256" + ("-zipf" if args.ids == "zipf" else ""), "params": n_params,
        "seq": args.seq, "accumulate": args.accumulate,
    }  # fmt: skip
    rows = []

    def record(system: str, schedule: str, tokens: int, run, *run_args) -> None:
        try:
            result = run(*run_args)
        except Exception as err:  # keep the other systems' numbers; say what failed
            torch.cuda.set_per_process_memory_fraction(1.0)
            result = {"step_s": float("nan"), "gpu_alloc_gib": float("nan"), "gpu_reserved_gib": float("nan"),
                      "host_peak": 0, "timeline": f"FAILED: {type(err).__name__}: {str(err)[:300]}"}  # fmt: skip
        row = {**common, "system": system, "schedule": schedule, "tokens": tokens, **result}
        row["tok_s"] = tokens * args.accumulate / row["step_s"] if tokens and row["step_s"] == row["step_s"] else 0.0
        row["host_peak_gib"] = row["host_peak"] / GIB
        row["host_b_per_param"] = row.pop("host_peak") / n_params
        rows.append(row)
        append_row(args.out, row)

    systems = args.systems.split(",")
    token_counts = [int(t) for t in args.tokens.split(",")]

    def shape(tokens: int) -> tuple:
        return tokens // args.seq, args.seq, args.steps, args.warmup

    if "d" in systems:
        record("d_cpu_adamw_floor", "", 0, run_floor, args.layers, max(1, os.cpu_count() - 1))
    if "e" in systems:
        up_gb, down_gb = (float(x) for x in args.copy_gb.split(","))
        record("e_floor_with_copies", "", 0, run_floor_with_copies, args.layers, max(1, os.cpu_count() - 1), up_gb,
               down_gb)  # fmt: skip
    if "a" in systems:
        module = BenchLM.create(args.layers)
        system = "a_slideformer" + engine_settings + strategy_settings
        default_threads = torch.get_num_threads()
        torch.set_num_threads(args.main_threads or default_threads)
        # schedule by schedule, "backward" first: run after "forward" (which keeps a step's fp32 gradients in RAM),
        # 32k "backward" read a host peak of 13.77 bytes per parameter; alone, 13.56-13.58
        for schedule in args.schedules.split(","):
            for tokens in token_counts:
                record(system, schedule, tokens, run_slideformer, module, schedule, *shape(tokens),
                       args.gpu_cap_gib, args.cpu_threads, args.trace_dir, config, args.accumulate, extra)  # fmt: skip
        del module
        torch.set_num_threads(default_threads)
    for tokens in token_counts:
        if "b" in systems:
            record("b_all_gpu", "", tokens, run_all_gpu, args.layers, *shape(tokens), args.trace_dir, args.accumulate)
        if "c" in systems:
            record("c_fsdp2_offload", "", tokens, run_fsdp2, args.layers, *shape(tokens))
    print(f"{'system':<18}{'schedule':<12}{'tokens':>7}{'tok/s':>9}{'step s':>8}{'GPU GiB':>9}{'host B/p':>9}")
    for r in rows:
        print(f"{r['system']:<18}{r['schedule']:<12}{r['tokens']:>7}{r['tok_s']:>9.0f}{r['step_s']:>8.3f}"
              f"{r['gpu_alloc_gib']:>9.1f}{r['host_b_per_param']:>9.1f}  {r['timeline']}")  # fmt: skip


if __name__ == "__main__":
    main()
