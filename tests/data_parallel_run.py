"""One data-parallel run on the CPU (gloo) or on GPUs (NCCL, ``--accelerator gpu``), as a user's script:
``python data_parallel_run.py STRATEGY OUT [options]``.

Lightning's launcher starts the other processes by running this file again, unless each process was started with the
rank variables set (``tests/forked_runs.py``, torchrun); the first process saves the trained weights to OUT.
``tests/test_data_parallel.py`` compares them with Lightning's DDP.
"""

import argparse
import datetime
import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import CausalLM, tiny_config, token_data  # noqa: E402
from lightning_slide import CausalLMModule, SlideFormerStrategy, TextDataModule, placement  # noqa: E402
from lightning_slide import strategy as strategy_module  # noqa: E402
from lightning_slide.engine import optim  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("strategy", choices=["ddp", "slideformer"])
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--num-nodes", type=int, default=1)
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--schedule", default="auto")
parser.add_argument("--seed-per-rank", action="store_true", help="each process starts from other weights")
parser.add_argument("--nvme-path", default=None)
parser.add_argument("--nvme-masters", action="store_true", help="the blocks' fp32 masters on disk too (bf16-mixed)")
parser.add_argument("--optimizer-state", default="fp32", help="SlideFormerStrategy(optimizer_state=...)")
parser.add_argument("--precision", default="32-true")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--save-at", type=int, default=None, help="a checkpoint after this step, in OUT's folder")
parser.add_argument("--resume", default=None, help="fit from this checkpoint")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--device-memory-gib", type=float, default=None, help="a budget: the GPU tier on the CPU")
parser.add_argument("--not-whole", action="store_true", help="the whole model 'does not fit' (tests/test_placement.py)")
parser.add_argument("--host-mib", type=int, default=None, help="the RAM the machine has free")
parser.add_argument("--die-at", type=int, default=None, help="the last process exits at this step, as if killed")
parser.add_argument("--text", choices=["batch", "step"], default=None, help="CausalLMModule on TextDataModule")
parser.add_argument("--dropout", type=float, default=0.0, help="--text: the attention's dropout")
parser.add_argument("--uneven", choices=["sized", "iterable"], help="each process a loader of its own, the last longer")
parser.add_argument("--stall-at", type=int, default=None, help="the last process stops answering at this step")
parser.add_argument("--timeout", type=float, default=None, help="SlideFormerStrategy(timeout=...), in seconds")
parser.add_argument("--nan-at", type=int, default=None, help="the last process's loss is NaN at this step")
parser.add_argument("--halve-grads", action="store_true", help="a callback halves the gradients before each step")
parser.add_argument("--pretrained", default=None, help="a module loading this directory as the README shows")
parser.add_argument("--report", default=None, help="each process writes REPORT.RANK: where its state lives")
parser.add_argument("--accelerator", default="cpu")
parser.add_argument("--placement", default="auto", help="SlideFormerStrategy(placement=...)")
parser.add_argument("--losses", action="store_true", help="the first process saves each step's loss to OUT.losses")
args = parser.parse_args()

if args.host_mib:
    strategy_module.available_host_bytes = lambda: args.host_mib << 20
if args.not_whole:
    placement.choose_tier = lambda *_: placement.Tier(False, "the whole model does not fit")
rank = int(os.environ.get("LOCAL_RANK", 0))
L.seed_everything(7 + (rank if args.seed_per_rank else 0), verbose=False)
if args.text:  # the quickstart's model and data, smaller
    config = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=262, max_position_embeddings=64,
                  attention_dropout=args.dropout)  # fmt: skip
    module = CausalLMModule(config=config, lr=3e-3, weight_decay=0.01, warmup_steps=2, normalize=args.text)
    data = TextDataModule(seq_len=32, batch_size=args.batch_size, val_fraction=0.0)
elif args.pretrained:

    class _Pretrained(CausalLM):
        def configure_model(self):  # the README's: the weights read only where the strategy needs them
            if self.model is not None:
                return
            if getattr(self.trainer.strategy, "loads_weights", True):
                self.model = AutoModelForCausalLM.from_pretrained(args.pretrained)
            else:
                with torch.device("meta"):
                    self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.pretrained))

    module, data = _Pretrained(None), None
else:
    module = CausalLM(tiny_config("llama", tied=True))
    data = None
if args.nan_at is not None:
    training_step = module.training_step

    def _nan_step(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        last = module.trainer.global_rank == module.trainer.world_size - 1
        return loss * float("nan") if module.trainer.global_step == args.nan_at and last else loss

    module.training_step = _nan_step
strategy = (
    "ddp"
    if args.strategy == "ddp"
    else SlideFormerStrategy(
        num_slots=2,
        update_schedule=args.schedule,
        nvme_path=args.nvme_path,
        optimizer_offload="nvme" if args.nvme_path else "cpu",
        nvme_masters=args.nvme_masters,
        optimizer_state=args.optimizer_state,
        device_memory_gib=args.device_memory_gib,
        placement=args.placement,
        **({"timeout": datetime.timedelta(seconds=args.timeout)} if args.timeout else {}),
    )  # fmt: skip
)


class _Rows(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter((row,) for row in self.rows)


class _Halve(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class _Die(L.Callback):
    def on_train_batch_start(self, trainer, *_):
        if trainer.global_step == args.die_at and trainer.global_rank == trainer.world_size - 1:
            os._exit(9)


STALL_S = 35  # the stall test's timeout is 15 s: the others must stop before this one wakes


class _Stall(L.Callback):
    def on_train_batch_start(self, trainer, *_):
        if trainer.global_step == args.stall_at and trainer.global_rank == trainer.world_size - 1:
            with open(f"{args.out}.stall", "w") as f:
                f.write(str(time.time()))
            time.sleep(STALL_S)


on_disk = [0]  # bytes of this process's NVMe state files, as training ends


class _Disk(L.Callback):
    def on_train_end(self, trainer, module):
        on_disk[0] = sum(os.path.getsize(path) for path in trainer.strategy.engine.optimizer.store.paths)


losses = []  # the first process's training loss, step by step


class _Losses(L.Callback):
    def on_train_batch_end(self, trainer, module, outputs, *_):
        losses.append(float(outputs["loss"]))


class _Mappings(L.Callback):
    def on_train_end(self, trainer, module):  # before the teardown lets the retained gradients' memory go
        in_training[0] = _shared_mappings()


in_training = [{}]  # this process's mappings of the node's shared memory, as training ends
updated = [0]  # elements this process's optimizer updated
if args.report:
    adam = optim.CpuOptimizer._adam

    def _counting(self, params, ps, *rest, **kwargs):  # ps: the parts of params updated
        updated[0] += sum(p.numel() for p in ps)
        return adam(self, params, ps, *rest, **kwargs)

    optim.CpuOptimizer._adam = _counting


held_at_plan = [None]  # bytes of parameter storage as the plan reads the RAM left
built_on_meta = [None]  # configure_model built the model on the meta device (it read no weights)
if args.report and args.strategy == "slideformer":
    plan_run = strategy.plan_run

    def _recording(trainer, module, *rest, **kwargs):
        held_at_plan[0] = sum(p.untyped_storage().nbytes() for p in module.parameters())
        return plan_run(trainer, module, *rest, **kwargs)

    strategy.plan_run = _recording
    configure_model = module.configure_model

    def _building():
        configure_model()
        built_on_meta[0] = all(p.is_meta for p in module.parameters())

    module.configure_model = _building


def _shared_mappings() -> dict[int, tuple[int, int]]:
    # this process's mappings of the node's shared state: inode -> (start, end) addresses
    found = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/lightning-slide" in line:
                span, _, _, _, inode = line.split()[:5]
                start, end = (int(x, 16) for x in span.split("-"))
                found[int(inode)] = (min(start, found.get(int(inode), (start, end))[0]), end)
    return found


saving = [ModelCheckpoint(os.path.dirname(args.out), "{step}", every_n_train_steps=args.save_at, save_top_k=-1)]
trainer = L.Trainer(
    strategy=strategy, accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
    max_steps=args.steps, logger=False,
    enable_checkpointing=args.save_at is not None,
    callbacks=(saving if args.save_at else []) + ([_Die()] if args.die_at is not None else [])
    + ([_Stall()] if args.stall_at is not None else [])
    + ([_Halve()] if args.halve_grads else [])
    + ([_Disk()] if args.report and args.nvme_path and args.strategy == "slideformer" else [])
    + ([_Mappings()] if args.report else [])
    + ([_Losses()] if args.losses else []),
    enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=args.clip, precision=args.precision,
    accumulate_grad_batches=args.accumulate, use_distributed_sampler=args.uneven is None,
)  # fmt: skip
rows = token_data(32)
if args.uneven:  # 6 rows per process, 8 for the last
    rows = rows[6 * rank : 6 * rank + (8 if rank == args.devices - 1 else 6)]
dataset = TensorDataset(rows) if args.uneven != "iterable" else _Rows(rows)
loader = None if data else DataLoader(dataset, batch_size=args.batch_size)
try:
    trainer.fit(module, loader, datamodule=data, ckpt_path=args.resume)
finally:
    if args.stall_at is not None:
        print(f"stopped at {time.time()}", file=sys.stderr)
if trainer.is_global_zero and args.strategy == "slideformer":
    print("kept on the device:", [u.name for u in strategy.plan.units if u.weights == "gpu"])
if trainer.is_global_zero:
    torch.save({k: v.detach().float().cpu() for k, v in module.state_dict().items()}, args.out)
    if args.losses:
        torch.save(losses, f"{args.out}.losses")
if args.report:
    spans = _shared_mappings()
    optimizer = trainer.optimizers[0]
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    inside = [any(a <= t.data_ptr() < b for a, b in spans.values()) for t in tensors]
    report = {"updated": updated[0], "inodes": sorted(in_training[0]), "shared": sum(inside),
              "private": len(inside) - sum(inside), "bytes": sum(b - a for a, b in in_training[0].values()),
              "held_at_plan": held_at_plan[0], "built_on_meta": built_on_meta[0], "on_disk": on_disk[0],
              "weights": [float(v.double().square().sum()) for v in module.state_dict().values()],
              "dtypes": sorted({str(p.dtype) for p in module.parameters()})}  # fmt: skip
    with open(f"{args.report}.{trainer.global_rank}", "w") as f:
        json.dump(report, f)
