"""Loss curves (GPU machine): the same training with and without the strategy, as ``slide fit`` runs it.

The quickstart recipe widened (hidden 1024, 8 blocks: 0.1 B parameters; ``--model quickstart``: as it is, for a CPU
run) on the built-in corpus, bf16-mixed: plain
Lightning (``--trainer.strategy auto``), ``strategy="slideformer"`` as it places the model (on a large GPU: whole on
the device), the same with ``placement="stream"`` (every block through the window, the optimizer on the CPU), streamed
with ``optimizer_state="bf16"``, streamed with every block's update a step late (``delayed_update=True``: the default
warmup of exact steps; with and without the bf16 state; ``slideformer_stream_delayed_warmup1``: one exact step,
``..._blocks2``: the first two blocks late), plain Lightning with the delayed rule as a callback (``delayed_rule.py``:
what the rule does without the strategy), and plain Lightning in fp32, the reference the bf16
runs are judged against (each run's root-mean-square distance to it is printed last).
Each run is a fresh ``slide fit`` process; ``train/loss`` is logged every 5 steps. Appends one CSV row per logged
step to --out (``plots.py`` draws them).

``--finetune``: a fine-tuning run instead of one from a random init: the model is first trained as the recipe trains
it (plain Lightning, fp32, --pretrain-steps) and exported, and each system then trains those weights on a task the
recipe's corpus does not hold (subtraction and products of the same number words), at --lr (default 1e-4 here).

    python benchmarks/bench_loss.py --out benchmarks/results/loss.csv
    python benchmarks/bench_loss.py --model quickstart --accelerator cpu   # the recipe's model, on the CPU
    python benchmarks/bench_loss.py --model quickstart --accelerator cpu --finetune
"""

from __future__ import annotations

import argparse
import csv
import datetime
import glob
import json
import os
import random
import re
import subprocess
import sys
import tempfile

from lightning_slide.data import NUMBER_WORDS
from results_csv import append_row, environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every block's update a step late (the plan alone would delay none of so small a model): the delay at its largest
STREAM_DELAYED = ["--trainer.strategy.init_args.placement", "stream", "--trainer.strategy.init_args.delayed_update",
                  "true", "--trainer.strategy.init_args.engine.delayed_blocks", "{layers}"]  # fmt: skip
SYSTEMS = {  # name: (`slide fit` overrides, precision; None: --precision)
    "plain": (["--trainer.strategy", "auto"], None),
    "slideformer": ([], None),
    "slideformer_stream": (["--trainer.strategy.init_args.placement", "stream"], None),
    "slideformer_stream_bf16_state": (
        ["--trainer.strategy.init_args.placement", "stream", "--trainer.strategy.init_args.optimizer_state", "bf16"],
        None,
    ),
    "slideformer_stream_delayed": (STREAM_DELAYED, None),
    "slideformer_stream_delayed_bf16_state": (
        STREAM_DELAYED + ["--trainer.strategy.init_args.optimizer_state", "bf16"],
        None,
    ),
    "plain_fp32": (["--trainer.strategy", "auto"], "32-true"),
    # the delayed rule without the strategy (``delayed_rule.py``): every block late after 20 exact steps
    "plain_delayed_rule": (
        ["--trainer.strategy", "auto", "--trainer.callbacks+=benchmarks.delayed_rule.DelayedRule"],
        None,
    ),
}
# a delayed system's name may end in _warmup<N> (N exact steps first) and _blocks<K> (the first K blocks late)
VARIANTS = {"warmup": "--trainer.strategy.init_args.delay_warmup",
            "blocks": "--trainer.strategy.init_args.engine.delayed_blocks"}  # fmt: skip


def overrides(system: str, blocks: int) -> tuple[list[str], str | None]:
    """A system's `slide fit` overrides and precision (None: --precision)."""
    variants = []
    while match := re.fullmatch(r"(.+)_(warmup|blocks)(\d+)", system):
        system, name, value = match.groups()
        variants += [VARIANTS[name], value]
    args, precision = SYSTEMS[system]
    args = [arg.format(layers=blocks) for arg in args] + variants
    return args, precision


MODELS = {  # name: (`slide fit` overrides, blocks)
    "quickstart-1024x8": (["--model.config.hidden_size", "1024", "--model.config.intermediate_size", "2816",
                           "--model.config.num_hidden_layers", "8", "--model.config.num_attention_heads", "16",
                           "--model.config.num_key_value_heads", "4"], 8),
    "quickstart": ([], 4),  # the recipe's own model (hidden 128): a CPU run
}  # fmt: skip


def run(system: str, model: str, steps: int, precision: str, accelerator: str, root: str, lr: str | None,
        start: list[str] = ()) -> list[tuple[int, float]]:  # fmt: skip
    """``slide fit`` of one system (``start``: more overrides, e.g. the fine-tuning's weights and data); its (step,
    train/loss) points."""
    recipe = os.path.join(ROOT, "recipes", "quickstart.yaml")
    command = [sys.executable, "-m", "lightning_slide", "fit", "--config", recipe, "--trainer.max_steps", str(steps),
               "--trainer.log_every_n_steps", "5", "--trainer.val_check_interval", str(steps), "--trainer.precision",
               precision, "--trainer.accelerator", accelerator, "--trainer.default_root_dir", root,
               "--trainer.enable_progress_bar", "false", *MODELS[model][0]]  # fmt: skip
    command += overrides(system, MODELS[model][1])[0] + (["--model.lr", lr] if lr else []) + list(start)
    subprocess.run(command, check=True, cwd=ROOT)  # cwd: benchmarks.delayed_rule importable
    (metrics,) = glob.glob(os.path.join(root, "lightning_logs", "*", "metrics.csv"))
    with open(metrics) as f:
        return [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f) if r.get("train/loss")]


def pretrained(model: str, steps: int, accelerator: str, folder: str) -> list[str]:
    """The ``slide fit`` overrides of a fine-tuning run: the model trained as the recipe trains it (plain Lightning,
    fp32, ``steps`` steps) and exported to ``folder``, and a new task written there."""
    root = os.path.join(folder, "pretraining")
    run("plain_fp32", model, steps, "32-true", accelerator, root, None)
    (run_dir,) = glob.glob(os.path.join(root, "lightning_logs", "*"))
    weights = os.path.join(folder, "model")
    subprocess.run([sys.executable, "-m", "lightning_slide", "export", "--config", os.path.join(run_dir, "config.yaml"),
                    "--ckpt_path", os.path.join(run_dir, "checkpoints", "last.ckpt"), "--out", weights],
                   check=True, cwd=ROOT)  # fmt: skip
    rng, task, words = random.Random(1), os.path.join(folder, "task.jsonl"), NUMBER_WORDS
    with open(task, "w") as f:
        for _ in range(2000):
            a, b = sorted((rng.randrange(10), rng.randrange(10)), reverse=True)
            text = f"{words[a]} minus {words[b]} is {a - b}. {words[a]} times {words[b]} is {a * b}."
            f.write(json.dumps({"text": text}) + "\n")
    return ["--model.model", weights, "--model.config", "null", "--data.path", task]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--model", choices=list(MODELS), default="quickstart-1024x8")
    parser.add_argument("--lr", default=None, help="another learning rate than the recipe's 3e-3 (--finetune: 1e-4)")
    parser.add_argument("--finetune", action="store_true", help="from the recipe's trained model, on a new task")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="--finetune: the recipe's training first")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "loss.csv")
    )
    args = parser.parse_args()
    env = environment() if args.accelerator == "gpu" else {"date": datetime.date.today().isoformat(), "gpu": "none"}
    folder = tempfile.TemporaryDirectory()
    start = pretrained(args.model, args.pretrain_steps, args.accelerator, folder.name) if args.finetune else []
    lr = args.lr or ("1e-4" if args.finetune else None)
    model = args.model + (f", fine-tuned after {args.pretrain_steps} steps" if args.finetune else "")
    model += f", lr {lr}" if lr else ""
    curves = {}
    for system in args.systems.split(","):
        precision = overrides(system, MODELS[args.model][1])[1] or args.precision
        with tempfile.TemporaryDirectory() as root:
            curves[system] = dict(run(system, args.model, args.steps, precision, args.accelerator, root, lr, start))
        for step, loss in curves[system].items():
            append_row(args.out, {**env, "model": model, "precision": precision,
                                  "system": system, "step": step, "train_loss": loss})  # fmt: skip
    if "plain_fp32" in curves:
        print("root-mean-square distance of train/loss to plain_fp32's:")
        for system, curve in curves.items():
            steps = sorted(set(curve) & set(curves["plain_fp32"]))
            rms = (sum((curve[s] - curves["plain_fp32"][s]) ** 2 for s in steps) / len(steps)) ** 0.5
            print(f"  {system:<32} {rms:.4f} over {len(steps)} logged steps")


if __name__ == "__main__":
    main()
