"""A model that fits (GPU machine): plain Lightning against ``strategy="slideformer"``, the module a user writes.

A Llama shape of 0.49 B parameters (hidden 2048, 8 blocks, 16 heads of which 4 key/value, vocabulary 32000),
micro-batches of 4 x 2048 tokens, bf16-mixed, AdamW, uncapped GPU, for each gradient accumulation (1, 2) and clipping
(none, 1.0). Every run is a fresh process with no environment variables set; the systems alternate, case by case,
for ``--rounds`` rounds. Reports the median seconds per optimizer step, the ratio to plain Lightning in the same
round, the peak GPU memory, and the placement the strategy chose. Appends CSV rows to --out.

    python benchmarks/bench_fits.py --out benchmarks/results/fits.csv
    python benchmarks/bench_fits.py --systems plain,slideformer,slideformer_stream --cases 1:none
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from results_csv import append_row, environment

SYSTEMS = {  # name: the Trainer's strategy (None: Lightning's default), with SlideFormerStrategy's arguments
    "plain": None,
    "slideformer": {},
    "slideformer_stream": {"placement": "stream"},
    "slideformer_own_attention": {"attention": None},
}


FIELDS = ("params", "step_s", "gpu_alloc_gib", "gpu_reserved_gib", "planned_gib", "placement", "error")


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


def child(system: str, accumulate: int, clip: float | None, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """One run in this process: the README's plain LightningModule under ``system``."""
    import lightning as L
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    import lightning_slide

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(llama_config())

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.1)

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate == 0:
                torch.cuda.synchronize()
                ends.append(time.perf_counter())

    torch.manual_seed(0)
    module = LM()
    kwargs = SYSTEMS[system]
    strategy = "auto" if kwargs is None else lightning_slide.SlideFormerStrategy(**kwargs)
    micro = (warmup + steps) * accumulate
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 32000, (batch, seq), generator=g) for _ in range(micro)]
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=warmup + steps,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=[Clock()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=None))
    times = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])]
    tier = getattr(trainer.strategy, "tier", None)
    placement = "" if tier is None else ("resident" if tier.resident else "stream") + f" ({tier.reason})"
    return {
        "params": sum(p.numel() for p in module.parameters()),
        "step_s": statistics.median(times),
        "gpu_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "planned_gib": (tier.need / 2**30) if tier is not None and tier.resident else "",
        "placement": placement,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default="plain,slideformer")
    parser.add_argument("--cases", default="1:none,1:1.0,2:none,2:1.0", help="accumulation:clip, comma-separated")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/fits.csv")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one run, printed as the last line
        system, accumulate, clip = args.child.split(":")
        result = child(system, int(accumulate), None if clip == "none" else float(clip), args.batch, args.seq,
                       args.steps, args.warmup)  # fmt: skip
        print(json.dumps(result))
        return
    env = environment()
    import lightning
    import transformers

    env.update(lightning=lightning.__version__, transformers=transformers.__version__)
    for round_ in range(args.rounds):
        for case in args.cases.split(","):
            results = {}
            for system in args.systems.split(","):
                sizes = ["--batch", args.batch, "--seq", args.seq, "--steps", args.steps, "--warmup", args.warmup]
                command = [sys.executable, __file__, "--child", f"{system}:{case}", *map(str, sizes)]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr, flush=True)
                    results[system] = {"error": done.stderr.strip().splitlines()[-1][:300]}
                    continue
                results[system] = json.loads(done.stdout.strip().splitlines()[-1])
            plain = results.get("plain", {}).get("step_s")
            for system, result in results.items():
                accumulate, clip = case.split(":")
                ratio = plain / result["step_s"] if plain and "step_s" in result else ""
                row = {**env, "model": "llama-2048x8-v32000", "system": system, "accumulate": accumulate, "clip": clip,
                       "tokens_per_micro_batch": args.batch * args.seq, "round": round_}  # fmt: skip
                row.update(dict.fromkeys(FIELDS, ""), **result, speed_vs_plain=ratio)
                append_row(args.out, row)


if __name__ == "__main__":
    main()
