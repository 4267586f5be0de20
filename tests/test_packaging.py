"""The package as a user's Python finds it: started in the project folder, beside Hugging Face's ``kernels``."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GENERATE = """
import kernels, lightning_slide, torch
from transformers import LlamaConfig, LlamaForCausalLM
from lightning_slide.kernels.attention import flash_attention

config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64)
model = LlamaForCausalLM(config).eval()
out = model.generate(torch.tensor([[1, 2, 3]]), min_new_tokens=4, max_new_tokens=4, do_sample=False)
print(out.shape[1])
print(kernels.__file__)
"""


@pytest.mark.skipif(
    not any(d.metadata["Name"] == "kernels" for d in importlib.metadata.distributions()),
    reason="Hugging Face's kernels is not installed (transformers before 5.25 does not need it)",
)
def test_python_started_in_the_project_folder_imports_transformers_models_and_generates():
    # sys.path[0] is the project folder for `python -c`, as for a script, a notebook or `python -m pytest` there
    done = subprocess.run([sys.executable, "-c", GENERATE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    length, kernels_file = done.stdout.splitlines()[-2:]
    assert length == "7"
    assert ROOT / "kernels" not in Path(kernels_file).resolve().parents  # Hugging Face's package, not ours
