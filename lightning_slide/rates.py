"""A step time predicted from a small table of machine rates, for ``slide plan`` and the placement log.

The model, fitted to the H200 runs of ``benchmarks/bench_core.py`` (benchmarks/NOTES.md, "Predicted step times"):

- the GPU computes 2 flops per weight and token for each pass over a matrix (forward; recompute of a streamed block;
  backward counts two, one for the input's gradient and one for the weight's), at ``gpu_tflops``; copies run beside
  it at ``pcie_gbs`` each way (fp32 masters up for the forward and again for the backward, converted on the GPU; fp32
  gradients down);
- the CPU optimizer steps ``cpu_params_per_s`` parameters a second (``cpu_bf16_params_per_s`` with bf16 moments,
  ``cpu_bf16_grad_params_per_s`` where they read bf16 gradients, which then go down in 2 bytes, not 4), or the disk
  moves the NVMe tier's state (read and written back) at ``disk_gbs``; a micro-batch after a window's first
  brings the retained fp32 gradients back up to add its own on the GPU (4 more bytes up per trained parameter);
- schedule "backward" updates while the backward runs, so the CPU starts when the forward ends; where the first blocks'
  updates are deferred, they run after the backward instead and overlap those blocks' next forward, the rest of the
  forward follows; "forward" updates after the backward, overlapping the next forward; "norm-first" runs a second
  backward that streams the updates;
- delayed blocks (``delay.py``): their updates, queued last, run on from the step's end through the next step's start
  and forward (no forward waits for them; a pass's forward takes at least its uploads) and write their next weights
  too (in the same pass with bf16 moments, 2 bytes more of ~20; else a cast at ``cpu_copy_params_per_s``); the CPU's
  whole work bounds the step;
- a streamed step also spends ``stream_start_s`` at its start, waiting for the last updates and the window's first
  uploads (fitted to the 2.8 B and 8 B runs);
- the resident tier is plain training on the GPU: no recompute, no copies, the optimizer on the GPU (memory-bound,
  ignored);
- several processes on a node, one per GPU, split its cores and its disk; sharing the state (in RAM, or each its
  rows' in files of its own), each moves down (and back up) only its share of the gradients' rows, over a PCIe link of
  its own, and steps only its share, so the CPU's time per step is one process's alone; the disk reads and writes the
  whole state once a step, whoever holds it; the gradients' collectives are not counted (they run beside the
  backward).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    """Machine rates (defaults: one H200 on PCIe 5 with 16 cores, measured; ``slide plan`` flags override them).

    Args:
        gpu_tflops: bf16 matmul rate in training, attention included (sequences of 4096).
        pcie_gbs: host-device copies, each way (GB/s).
        cpu_params_per_s: torch's fused CPU AdamW, all cores but one.
        cpu_bf16_params_per_s: the same with bf16 moments (``engine/adam_bf16.py``; 20 bytes a parameter, not 28).
        cpu_bf16_grad_params_per_s: bf16 moments reading bf16 gradients as they are (18 bytes a parameter).
        cpu_copy_params_per_s: the cast of fp32 masters into a delayed block's bf16 weights (fp32 moments).
        disk_gbs: the NVMe tier's reads and writes together (GB/s).
        stream_start_s: a streamed step's start, before the window and the updates overlap the compute.
    """

    gpu_tflops: float = 500.0
    pcie_gbs: float = 50.0
    cpu_params_per_s: float = 3.5e9
    cpu_bf16_params_per_s: float = 4.2e9  # 1.2x the fp32 rate, as bench_cpu_adam.py --state measured side by side
    cpu_bf16_grad_params_per_s: float = 5.0e9  # 1.15-1.3x the fp32 gradients' rate (bench_cpu_adam.py --state)
    cpu_copy_params_per_s: float = 4.7e9  # an H100 host, in the 8k step (benchmarks/NOTES.md, session 39)
    disk_gbs: float = 3.0
    stream_start_s: float = 0.1


@dataclass(frozen=True)
class Work:
    """What one optimizer step moves and computes."""

    tokens: int  # per micro-batch
    micro_batches: int
    block_matmul: int  # weights of the streamed blocks' matrices (recomputed)
    other_matmul: int  # weights of other matrices (head; everything when resident)
    streamed: int  # parameters whose weights go up each pass
    trained: int  # parameters the CPU optimizer steps (0 when resident)
    disk_state_bytes: int  # one process's NVMe state, read and written once a step
    processes: int = 1  # of the node: they split its cores and its disk
    share: int = 1  # of them, those that split the trained rows (shared_host.py)
    deferred: int = 0  # of the trained, those updated during the next forward (schedule "backward")
    deferred_matmul: int = 0  # weights of their matrices
    bf16_state: bool = False  # Adam's moments in bf16 (optimizer_state="bf16")
    bf16_grads: bool = False  # with them, the matrices' gradients stay bf16 (a bf16 compute's) down to the update
    delayed: int = 0  # of the trained, those updated a step late (delay.py)
    delayed_matmul: int = 0  # weights of their matrices


def predict_step_s(work: Work, schedule: str | None, rates: Rates = Rates()) -> float:
    """Seconds per optimizer step (``schedule`` ``None``: the resident tier)."""
    flop_s = rates.gpu_tflops * 1e12
    recompute = 1 if schedule is not None else 0
    forward = 2 * (work.block_matmul + work.other_matmul) * work.tokens / flop_s
    backward = (4 + 2 * recompute) * work.block_matmul * work.tokens / flop_s
    backward += 4 * work.other_matmul * work.tokens / flop_s
    if schedule is None:
        return work.micro_batches * (forward + backward)
    up = 2 * (4 * work.streamed - 2 * work.delayed_matmul) / (rates.pcie_gbs * 1e9)  # delayed: bf16 copies
    readback = 4 * work.trained / work.share / (rates.pcie_gbs * 1e9)
    down = (2 if work.bf16_grads else 4) * work.trained / work.share / (rates.pcie_gbs * 1e9)
    second = backward if schedule == "norm-first" else 0.0
    later = (work.micro_batches - 1) * max(forward + backward, up + readback, down)
    gpu = max(forward + backward, up, down) + later + second
    per_s = rates.cpu_params_per_s
    if work.bf16_state:
        per_s = rates.cpu_bf16_grad_params_per_s if work.bf16_grads else rates.cpu_bf16_params_per_s
    cpu = work.trained / work.share / (per_s / work.processes)
    update = max(cpu, work.processes * work.disk_state_bytes / (rates.disk_gbs * 1e9))
    if work.delayed:  # the copies are written with their updates (bf16 moments: in the same pass)
        copy_rate = 10 * per_s if work.bf16_state else rates.cpu_copy_params_per_s
        late = update * work.delayed / work.trained + work.delayed / work.share / (copy_rate / work.processes)
        early = update * (1 - work.delayed / work.trained)
        start, one_pass = rates.stream_start_s, max(forward, up / 2)
        # "backward": theirs from the last step's end, beside the stream's start and the forward, the others' after
        # their gradients; "forward": the others' before their next forward, theirs during its backward
        if schedule == "backward":
            chain = max(start + one_pass, late) + early
        else:
            chain = start + max(one_pass, early) + backward
        return max(start + gpu, chain, early + late)
    if schedule == "backward":
        late = update * work.deferred / work.trained if work.trained else 0.0
        matmul = work.block_matmul + work.other_matmul
        rest = forward * (1 - work.deferred_matmul / matmul) if matmul else forward
        chain = rest + max(backward, update - late) + late
    else:
        chain = {"forward": backward, "norm-first": forward + backward}[schedule] + update
    return rates.stream_start_s + max(gpu, chain)
