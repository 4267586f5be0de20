"""Two GPUs (NCCL): ``devices=2`` on CUDA trains as Lightning's DDP, resumes exactly and stops when a process dies.

The Run issue's GPU tests; they need a machine with two GPUs and are skipped elsewhere (the same runs on the CPU,
with gloo, are in ``tests/test_data_parallel.py``).
"""

import time
from functools import partial

import pytest
import test_data_parallel
import torch

from helpers import global_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
# started as a user starts the script (Lightning's launcher starts the other process), not forked (forked_runs.py)
_run, _trained = (partial(f, forked=False) for f in (test_data_parallel._run, test_data_parallel._trained))
ON_GPUS = ("--accelerator", "gpu", "--devices", "2", "--placement", "stream")  # the tiny model would fit whole


def test_two_gpus_in_bf16_train_as_ddp(tmp_path):
    # 50 steps: each loss within 1 % of DDP's; the weights within the bf16 bound of DDP in fp32
    options = (*ON_GPUS, "--steps", "50", "--losses", "--clip", "1.0")
    reference = _trained("ddp", tmp_path / "fp32.pt", *options)
    plain = _trained("ddp", tmp_path / "plain.pt", *options, "--precision", "bf16-mixed")
    ours = _trained("slideformer", tmp_path / "ours.pt", *options, "--precision", "bf16-mixed")
    plain_losses = torch.load(f"{tmp_path / 'plain.pt'}.losses")
    our_losses = torch.load(f"{tmp_path / 'ours.pt'}.losses")
    assert len(our_losses) == len(plain_losses) == 50
    worst = max(abs(o - p) / abs(p) for o, p in zip(our_losses, plain_losses))
    assert worst <= 0.01, worst
    assert global_error(ours, reference) <= 2 * global_error(plain, reference)


def test_a_checkpoint_of_two_gpus_resumes_exactly(tmp_path):
    straight = _trained("slideformer", tmp_path / "straight.pt", *ON_GPUS, "--steps", "12", "--save-at", "8")
    checkpoint = str(tmp_path / "step=8.ckpt")
    resumed = _trained("slideformer", tmp_path / "resumed.pt", *ON_GPUS, "--steps", "12", "--resume", checkpoint)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_gpu_process_that_dies_stops_the_other_within_the_timeout(tmp_path):
    start = time.monotonic()
    done = _run("slideformer", tmp_path / "ours.pt", *ON_GPUS, "--steps", "6", "--die-at", "2", "--timeout", "60")
    assert done.returncode != 0
    assert time.monotonic() - start < 300, "the surviving process waited past its collectives' timeout"
