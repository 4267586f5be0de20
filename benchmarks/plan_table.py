"""`slide plan` past this machine (no GPU needed): Llama-3.1-8B, Llama-3.1-70B and a 123 B Llama shape (Mistral
Large 2's dimensions) with the Llama-3.1-8B full fine-tune recipe (clip 1.0) at --batch x 4096 tokens per step, no
accumulation, on a 24 GiB GPU with 128, 256 and 1536 GiB of RAM: without NVMe (``llama3_1_8b_full.yaml``: masters,
AdamW state and the step's gradients in RAM), and with 4000 GiB free on one (``llama3_1_8b_full_nvme.yaml`` with
``nvme_masters: true``: the AdamW state and the blocks' fp32 masters on disk, bf16 block weights in RAM). The configs
say ``dtype: bfloat16``, as the released ones do. ``--devices N``: a machine of N such GPUs, one process each
(``--trainer.devices N``: the state once for them all, the first process loading the model). Prints a Markdown table and
appends CSV rows to --out.

    python benchmarks/plan_table.py --out benchmarks/results/plans.csv
    python benchmarks/plan_table.py --models Llama-3.1-70B --host-memory 1536,2048 --devices 4 --no-nvme
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from transformers import LlamaConfig

from results_csv import append_row

MODELS = {
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "Llama-3.1-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "123B (Llama shape)": dict(
        hidden_size=12288, intermediate_size=28672, num_hidden_layers=88, num_attention_heads=96
    ),
}
VOCAB = {"Llama-3.1-8B": 128256, "Llama-3.1-70B": 128256, "123B (Llama shape)": 32768}


def config_dir(root: str, name: str) -> str:
    path = os.path.join(root, name.split()[0])
    LlamaConfig(**MODELS[name], num_key_value_heads=8, vocab_size=VOCAB[name], max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16").save_pretrained(path)  # fmt: skip
    return path


def slide_plan(model_dir: str, gpu: float, host: float, nvme: float | None, batch: int, devices: int) -> dict:
    recipe = "recipes/llama3_1_8b_full.yaml" if nvme is None else "recipes/llama3_1_8b_full_nvme.yaml"
    argv = [sys.executable, "-m", "lightning_slide", "plan", "--config", recipe, "--model.model", model_dir,
            "--gpu-memory", str(gpu), "--host-memory", str(host), "--json", "--trainer.accumulate_grad_batches", "1",
            "--data.batch_size", str(batch), "--trainer.devices", str(devices)]  # fmt: skip
    if nvme is not None:
        argv += ["--nvme-free", str(nvme), "--trainer.strategy.init_args.nvme_masters", "true"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-memory", type=float, default=24.0)
    parser.add_argument("--host-memory", default="128,256,1536")
    parser.add_argument("--nvme-free", type=float, default=4000.0, help="GiB free on the NVMe disk of the 'with' rows")
    parser.add_argument("--batch", type=int, default=2, help="sequences of 4096 tokens per step")
    parser.add_argument("--devices", type=int, default=1, help="GPUs of the machine, one process each")
    parser.add_argument("--models", default=",".join(MODELS), help="of: " + ", ".join(MODELS))
    parser.add_argument("--no-nvme", action="store_true", help="only the rows without NVMe")
    parser.add_argument("--out", default="benchmarks/results/plans.csv")
    args = parser.parse_args()
    gib = 2**30
    table = [
        "| model | GPUs | RAM | NVMe | fits | schedule | kept on GPU | offloaded inputs | GPU | host | disk | step |"
        " tok/s |"
    ]
    table.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            model_dir = config_dir(root, name)
            for host in (float(h) for h in args.host_memory.split(",")):
                for nvme in (None,) if args.no_nvme else (None, args.nvme_free):
                    plan = slide_plan(model_dir, args.gpu_memory, host, nvme, args.batch, args.devices)
                    fits = plan["fits"]
                    step = plan.get("predicted_step_s")
                    kept = [u["name"] for u in plan.get("units", []) if u["weights"] == "gpu"]
                    tokens = plan.get("tokens_per_batch")
                    tokens = tokens * args.devices if tokens else tokens  # every GPU's
                    row = {
                        "date": datetime.date.today().isoformat(), "model": name, "devices": args.devices,
                        "gpu_gib": args.gpu_memory,
                        "host_gib": host, "nvme_free_gib": nvme or 0, "fits": fits, "schedule": plan.get("schedule"),
                        "kept_on_gpu": len(kept), "offloaded_blocks": plan.get("offloaded_blocks"),
                        "gpu_gib_planned": plan.get("gpu_bytes", 0) / gib,
                        "host_gib_planned": plan.get("host_bytes", 0) / gib,
                        "disk_gib_planned": plan.get("disk_bytes", 0) / gib, "predicted_step_s": step,
                        "tokens_per_step": tokens, "reason": "" if fits else plan.get("reason", ""),
                    }  # fmt: skip
                    append_row(args.out, row)
                    speed = f"{tokens / step:,.0f}" if fits and step and tokens else ""
                    shown = f"{step:.1f} s" if fits and step else ""
                    table.append(
                        f"| {name} | {args.devices} | {host:.0f} GiB | {'yes' if nvme else 'no'} |"
                        f" {'yes' if fits else 'no'} |"
                        f" {plan.get('schedule') or ''} | {', '.join(k.split('.')[-1] for k in kept) or '-'} |"
                        f" {plan.get('offloaded_blocks', '')} | {row['gpu_gib_planned']:.1f} |"
                        f" {row['host_gib_planned']:.0f} | {row['disk_gib_planned']:.0f} | {shown} | {speed} |"
                    )  # fmt: skip
    print("\n".join(table))


if __name__ == "__main__":
    main()
