"""Adam's moments in bf16 (``optimizer_state="bf16"``): the CPU kernel of ``adam_bf16.c``, built once with the
machine's C compiler (its threads from torch's OpenMP runtime) and called through ctypes, on CUDA tensors its Triton
twin (``kernels/adam_bf16.py``: the units kept on the GPU, rows updated there), and ``adam_bf16_ref``, the same
arithmetic in torch ops (the tests' reference).

Half the bytes of fp32 moments in RAM and on disk, and 20 instead of 28 bytes of memory traffic per parameter and update
(the CPU step is memory-bound); 18 where the gradient comes in bf16, as a bf16 matmul gives it. The moments are stored
with stochastic rounding (``adam_bf16.c`` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import astuple, dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("adam_bf16.c")
# no FMA contraction: the kernel rounds each operation as torch's ops do, so adam_bf16_ref equals it bit for bit
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
_GOLDEN = 0x9E3779B9


@dataclass(frozen=True)
class AdamArgs:
    """One step's scalars for every tensor of a param group (``torch.optim.Adam``'s formulas), as the kernel takes
    them: computed once here, so that the kernel and its torch reference round the same values."""

    sign: float  # the gradient's factor: 1 / the clipping divisor, negated to maximize
    keep: float  # AdamW: 1 - lr * weight_decay (the parameter shrinks); Adam: 1
    l2: float  # Adam: weight_decay (added to the gradient); AdamW: 0
    b1c: float  # 1 - beta1
    beta2: float
    b2c: float  # 1 - beta2
    eps: float
    step_size: float  # lr / (1 - beta1 ** step)
    inv_bias2_sqrt: float  # 1 / sqrt(1 - beta2 ** step): torch divides by a scalar as it multiplies by its inverse

    @classmethod
    def of(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
           maximize: bool, step: int, scale: float = 1.0) -> AdamArgs:  # fmt: skip
        """The scalars of step ``step`` (counted from 1); ``scale`` multiplies the gradient."""
        return cls(
            sign=-scale if maximize else scale, keep=1.0 - lr * weight_decay if decoupled else 1.0,
            l2=0.0 if decoupled else weight_decay, b1c=1.0 - beta1, beta2=beta2, b2c=1.0 - beta2, eps=eps,
            step_size=lr / (1.0 - beta1**step), inv_bias2_sqrt=1.0 / math.sqrt(1.0 - beta2**step),
        )  # fmt: skip


def step(p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Tensor | None, args: AdamArgs, seed: int, *, index0: int = 0,
         rows: Tensor | None = None, threads: int = 1, copy: Tensor | None = None) -> None:  # fmt: skip
    """Update the contiguous fp32 ``p`` with the gradient ``g`` (fp32, or bf16 read as it is) and the bf16 moments
    ``m``, ``v`` (``vmax``: amsgrad's running maximum) in place, on up to ``threads`` threads (on CUDA: the Triton
    kernel of ``kernels/adam_bf16.py``, the same bits). The rounding's random bits come from ``seed`` and each
    element's index in its whole parameter: ``p`` is the part that starts at element ``index0``, or (``rows``, int64)
    those leading rows of it, gathered. ``copy`` (bf16, on the CPU): receives the updated ``p``, as ``p.bfloat16()``;
    it may be ``g`` itself (bf16, whole): each value then takes its gradient's place."""
    n = p.numel()
    tensors = (p, g, m, v) + tuple(t for t in (vmax, copy) if t is not None)
    device = p.device.type
    if not (device in ("cpu", "cuda") and all(t.is_contiguous() and t.device == p.device and t.numel() == n
                                              for t in tensors)):  # fmt: skip
        raise ValueError("adam_bf16.step takes contiguous tensors of one size on one CPU or CUDA device.")
    if g.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adam_bf16.step takes an fp32 or bf16 gradient; got {g.dtype}.")
    bf16_grad = int(g.dtype == torch.bfloat16)
    if copy is not None and copy.data_ptr() == g.data_ptr() and not (bf16_grad and rows is None):
        raise ValueError("adam_bf16.step writes the copy into the gradient's place only for a whole bf16 gradient.")
    if n == 0:
        return
    if device == "cuda":
        if copy is not None:
            raise ValueError("adam_bf16.step writes copies on the CPU only.")
        from ..kernels.adam_bf16 import adam_bf16  # Triton: imported where a GPU needs it

        rows = rows.to(p.device, torch.int64).contiguous() if rows is not None else None
        adam_bf16(p, g, m, v, vmax, astuple(args), seed, index0=index0, rows=rows)
        return
    arrays = [t.data_ptr() for t in (p, g, m, v)] + [t.data_ptr() if t is not None else None for t in (vmax, copy)]
    scalars = (*astuple(args), seed & 0xFFFFFFFF)
    if rows is None:
        library().adam_bf16(n, index0, threads, bf16_grad, *arrays, *scalars)
    else:
        if rows.dtype != torch.int64 or rows.device.type != "cpu":
            raise ValueError("adam_bf16.step takes the rows as int64 on the CPU.")
        rows = rows.contiguous()
        library().adam_bf16_rows(len(rows), n // len(rows), rows.data_ptr(), threads, bf16_grad, *arrays, *scalars)


def adam_bf16_ref(p: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Tensor | None, args: AdamArgs, seed: int, *,
                  index0: int = 0, rows: Tensor | None = None) -> None:  # fmt: skip
    """:func:`step` in torch ops, on any device: the same roundings, the same random bits."""
    width = p.numel() // len(rows) if rows is not None else 1
    if rows is None:
        index = torch.arange(p.numel(), device=p.device) + index0
    else:
        index = (rows.to(p.device)[:, None] * width + torch.arange(width, device=p.device)).flatten()
    index = index.view(p.shape)
    grad = g.float() * args.sign + p * args.l2
    param = p * args.keep
    mi, vi = m.float(), v.float()
    mi = mi + (grad - mi) * args.b1c
    vi = vi * args.beta2 + grad * args.b2c * grad
    bits = _mix((index * _GOLDEN & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF))
    second = vi
    if vmax is not None:
        second = torch.maximum(vmax.float(), vi)
        vmax.copy_(_narrow(second, _mix(bits)))
    root = second.double().sqrt().float()  # correctly rounded, as sqrtf (torch's float sqrt may be 1 ulp off)
    p.copy_(param - mi * args.step_size / (root * args.inv_bias2_sqrt + args.eps))
    m.copy_(_narrow(mi, bits))
    v.copy_(_narrow(vi, bits >> 16))


def _mix(x: Tensor) -> Tensor:
    # adam_bf16.c's mix(), on uint32 values held in int64
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35 & 0xFFFFFFFF
    return x ^ (x >> 16)


def _narrow(f: Tensor, noise: Tensor) -> Tensor:
    # adam_bf16.c's narrow(): fp32 to bf16, rounded up with the probability of the bits dropped
    u = f.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    finite = (u & 0x7F800000) != 0x7F800000
    u = (u + (noise & 0xFFFF) * finite) & 0xFFFFFFFF
    return (u >> 16).to(torch.int32).to(torch.int16).view(torch.bfloat16)


@cache
def library() -> ctypes.CDLL:
    """The built kernel, built on first use into the cache directory (again when its source, the compiler's flags or
    the processor change). Refused with what to do where no C compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(
            "optimizer_state='bf16' builds a small C kernel (lightning_slide/engine/adam_bf16.c) with the machine's C"
            " compiler, and none was found (cc or gcc on PATH, or $CC). Install one (e.g. apt-get install gcc) or"
            " train with optimizer_state='fp32'."
        )
    source = SOURCE.read_bytes()
    runtime = _openmp_runtime()
    key = b"\0".join([source, compiler.encode(), " ".join(FLAGS + runtime).encode(), _processor()])
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_slide"
    target = cache_dir / f"adam_bf16-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            built, objects = Path(scratch) / target.name, Path(scratch) / "adam_bf16.o"
            commands = [[compiler, *FLAGS, "-fopenmp", "-fPIC", "-c", str(SOURCE), "-o", str(objects)],
                        [compiler, "-shared", str(objects), *runtime, "-o", str(built)]]  # fmt: skip
            why = None
            try:
                for command in commands:
                    done = subprocess.run(command, capture_output=True, text=True)
                    if done.returncode != 0:
                        why = done.stderr.strip()[-1500:]
                        break
            except OSError as err:
                why = str(err)
            if why is not None:
                raise RuntimeError(
                    f"optimizer_state='bf16' could not build its C kernel with {compiler}: {why} Train with"
                    " optimizer_state='fp32', or point $CC at a working C compiler."
                )
            os.replace(built, target)  # whole, also where several processes build it at once
    library = ctypes.CDLL(str(target))
    pointer, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    arguments = [ctypes.c_int, ctypes.c_int] + [pointer] * 6 + [f32] * 9 + [ctypes.c_uint32]
    library.adam_bf16.argtypes = [i64, i64, *arguments]
    library.adam_bf16_rows.argtypes = [i64, i64, pointer, *arguments]
    library.adam_bf16.restype = library.adam_bf16_rows.restype = None
    return library


def _openmp_runtime() -> tuple[str, ...]:
    # the link flags of torch's own OpenMP runtime, where its wheel ships one: the kernel's threads are then torch's (a
    # second runtime's threads would compete with torch's, which spin between its operations); else the compiler's
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(str(f) for f in lib.glob("libgomp*.so*"))
    return (found[0], f"-Wl,-rpath,{lib}") if found else ("-lgomp",)


def _processor() -> bytes:
    # what -march=native builds for: the processor's model and flags where Linux tells them
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [line for line in f.read().splitlines() if line.startswith((b"model name", b"flags"))][:2]
    except OSError:
        lines = []
    return b"\n".join(lines) or platform.processor().encode()
