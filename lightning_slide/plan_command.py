"""``slide plan``: the placement plan of a recipe for a machine described by flags, without weights or a GPU.

    slide plan --config recipes/llama3_1_8b_full.yaml --model.model ./llama-8b-config --gpu-memory 24 --host-memory 128
    slide plan --config recipes/qwen2_5_32b_lora.yaml --gpu-memory 24 --host-memory 256 --nvme-free 2000 --json

The model is built from its config on the meta device (``--model.model`` may be a directory holding only
``config.json``), and the strategy makes the plan it would make at setup, from these figures only: ``--gpu-memory``
less ``CUDA_CONTEXT_GIB`` (what the CUDA context takes outside the allocator), ``--host-memory`` less
``host_reserve`` (the operating system and the process itself) and less the model as loaded, no ``ulimit -l`` limit,
and NVMe only with ``--nvme-free``. With ``--trainer.devices N`` (GPUs of the machine), the node's first process
loads the model (the others build it on the meta device and map its weights) and the N processes plan on 1/N of what
is left each, holding the state once between them; the host and disk figures printed are the node's. The predicted
step time comes from :class:`~lightning_slide.rates.Rates`, whose figures the ``--rate-*`` flags override. Exit status
0 when the run fits, 1 when it does not (the reason printed).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import fields, replace

import torch

from .cli import SlideCLI, trainer_defaults
from .data import TextDataModule
from .engine.planner import GIB
from .engine.shared_host import SharedHost
from .model_switches import switch_model
from .models import find_layout
from .module import CausalLMModule
from .placement import Machine
from .rates import Rates

CUDA_CONTEXT_GIB = 0.5


def host_reserve(total: int) -> int:
    """RAM a run cannot count on: the larger of 4 GiB and 5 % of the machine's."""
    return max(4 * GIB, total // 20)


def plan(argv: list[str]) -> int:
    """``slide plan`` with ``argv`` (its flags and the CLI's usual ones); returns the exit status."""
    parser = argparse.ArgumentParser(prog="slide plan", description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="the GPU's memory")
    parser.add_argument("--host-memory", type=float, required=True, metavar="GIB", help="the machine's total RAM")
    parser.add_argument("--nvme-free", type=float, metavar="GIB", help="free space on an NVMe disk (none if unset)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    for field in fields(Rates):
        parser.add_argument(f"--rate-{field.name.replace('_', '-')}", type=float, metavar="X")
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    rates = replace(Rates(), **{f.name: v for f in fields(Rates) if (v := getattr(args, f"rate_{f.name}")) is not None})
    try:
        with _nvme_assumed(args.nvme_free is not None), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # it is: from `slide plan`
            result = _plan(rest, args, rates)
    except (ValueError, OSError) as err:  # what the recipe asks cannot be planned (NVMe without --nvme-free, ...)
        print(json.dumps({"fits": False, "reason": str(err)}) if args.json else f"does not fit: {err}")
        return 1
    print(json.dumps(result.to_json(), default=str) if args.json else result.table())
    return 0 if result.fits else 1


@contextmanager
def _nvme_assumed(given: bool):
    # the strategy looks for $SLIDE_NVME_PATH: a scratch directory (never written) when --nvme-free says there is a
    # disk, none otherwise (this machine's disks are not the planned one's)
    before = os.environ.pop("SLIDE_NVME_PATH", None)
    with tempfile.TemporaryDirectory() as scratch:
        if given:
            os.environ["SLIDE_NVME_PATH"] = scratch
        try:
            yield
        finally:
            os.environ.pop("SLIDE_NVME_PATH", None)
            if before is not None:
                os.environ["SLIDE_NVME_PATH"] = before


def _plan(cli_args: list[str], args: argparse.Namespace, rates: Rates):
    cli = SlideCLI(CausalLMModule, TextDataModule, trainer_defaults=trainer_defaults(), run=False, args=cli_args)
    module, trainer, data = cli.model, cli.trainer, cli.datamodule
    module.trainer = trainer
    module.configure_meta_model()
    optimizer = module.make_optimizer()
    loaded = sum(p.numel() * p.element_size() for p in module.parameters())
    total = int(args.host_memory * GIB)
    strategy = trainer.strategy
    # --trainer.devices N: N processes, one per GPU, the first loading the model, each planning on its share of the
    # RAM and the disk, as the strategy's processes do
    share = strategy.num_processes
    machine = Machine(
        device=int((args.gpu_memory - CUDA_CONTEXT_GIB) * GIB),
        host=(total - host_reserve(total) - loaded) // share,
        disk=int(args.nvme_free * GIB) // share if args.nvme_free is not None else None,
    )
    layout = find_layout(module, strategy.blocks)
    shared = SharedHost.on_paper(share) if share > 1 else None
    # the model as the strategy switches it on a GPU before its plan (the attention, the fused ops); undone after,
    # as some switches patch transformers' modules for every model of the process
    restores = switch_model(module, layout, attention=strategy.attention, fused_ops=strategy.fused_ops, cuda=True,
                            dtype=strategy.precision_plugin.compute_dtype, fitting=True)  # fmt: skip
    try:
        return strategy.plan_run(trainer, module, layout, optimizer, torch.device("cuda"), data.tokens_per_batch,
                                 machine, rates, shared)  # fmt: skip
    finally:
        while restores:
            restores.pop()()
