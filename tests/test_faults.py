"""Faults injected the way they happen: a process SIGKILLed (as the OOM killer does) during a checkpoint save or
during a step, in both optimizer-state tiers; the run resumed from the newest complete checkpoint trains exactly as
one that was never interrupted."""

import os
import signal

import forked_runs
import pytest
import torch

from helpers import CausalLM, fit, max_rel_error, tiny_config
from lightning_slide import SlideFormerStrategy

KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from helpers import CausalLM, fit, tiny_config
from lightning_slide import SlideFormerStrategy, checkpoint_io

when, tier, root = {when!r}, {tier!r}, {root!r}


class KillMidStep(L.Callback):
    def on_before_optimizer_step(self, trainer, *args):  # the step's backward done, its updates under way
        if when == "mid-step" and trainer.global_step == 9:
            os.kill(os.getpid(), signal.SIGKILL)


if when == "mid-save":
    save = checkpoint_io._save

    def dying(checkpoint, file):  # the save at step 8: part of the file written, then the process is gone
        if checkpoint.get("global_step") == 8:
            with open(file, "wb") as f:
                f.write(bytes(4096))
            os.kill(os.getpid(), signal.SIGKILL)
        save(checkpoint, file)

    checkpoint_io._save = dying

module = CausalLM(tiny_config("llama"))
module.load_state_dict(torch.load(os.path.join(root, "init.pt")))
strategy = SlideFormerStrategy(num_slots=2, optimizer_offload=tier, nvme_path=os.path.join(root, "nvme"))
saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=4, save_last=True, save_top_k=-1)
fit(module, strategy, steps=12, enable_checkpointing=True, callbacks=[saver, KillMidStep()])
"""


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("when", ["mid-save", "mid-step"])
def test_a_run_killed_mid_save_or_mid_step_resumes_exactly(tmp_path, tier, when):
    module = CausalLM(tiny_config("llama"))
    torch.save(module.state_dict(), tmp_path / "init.pt")
    (tmp_path / "nvme").mkdir()

    def strategy():
        return SlideFormerStrategy(num_slots=2, optimizer_offload=tier, nvme_path=str(tmp_path / "nvme"))

    straight, _ = fit(module, strategy(), steps=12)
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=os.path.dirname(__file__), when=when, tier=tier, root=str(tmp_path)))
    done = forked_runs.run(str(script), processes=1)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    # every 4 steps, one epoch of the test data (a plain DataLoader resumes exactly only at an epoch's end)
    newest = 4 if when == "mid-save" else 8  # the step-8 save died, or the run died after it
    assert torch.load(last / "checkpoint.pt" if last.is_dir() else last, weights_only=True)["global_step"] == newest
    resumed, _ = fit(module, strategy(), steps=12, ckpt_path=str(last))
    err, where = max_rel_error(resumed, straight)
    assert err == 0, f"{where}: {err:.2e}"
    assert list((tmp_path / "nvme").iterdir()) == []  # the killed run's state removed, the resumed run's too
