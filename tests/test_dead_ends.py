"""The recompute leaves out the products nothing reads (engine/dead_ends.py): which layers the probe finds, and
training with them left out equal to the full recompute bit for bit."""

from contextlib import contextmanager
from types import MethodType

import pytest
import torch
from torch import nn

import lightning_slide.engine.dead_ends as dead_ends
from helpers import VOCAB, CausalLM, StackLM, StackModel, fit, streamed, tiny_config
from lightning_slide.engine.config import EngineConfig


class _Block(nn.Module):
    """A residual MLP block whose output layer's product is read as ``how`` says."""

    def __init__(self, how: str, width: int = 16) -> None:
        super().__init__()
        self.how = how
        self.up = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width, bias=how == "bias")
        self.dropout = nn.Dropout(0.1 if how == "dropout" else 0.0)  # p = 0 returns its input as it is
        if how == "patched":  # a forward of the instance's own: what it computes is not known
            self.out.forward = MethodType(lambda layer, h: nn.functional.linear(h, layer.weight), self.out)

    def forward(self, x):
        h = torch.relu(self.up(x))
        y = self.out(h.mT.contiguous().mT if self.how == "strided" else h)  # strided: the product taken as torch does
        if self.how == "branch" and y.abs().amax() > 1e9:  # its values read by a comparison
            y = y.clamp(-1e9, 1e9)
        if self.how == "in-place":
            return y.add_(x)
        if self.how == "scaled":
            return x + 0.5 * y
        return x + self.dropout(y)


class _BlocksModel(StackModel):
    def __init__(self, how: str) -> None:
        super().__init__(depth=3)
        self.blocks = nn.ModuleList(_Block(how) for _ in range(3))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class _BlocksLM(StackLM):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.net = _BlocksModel(how)


def _found(monkeypatch) -> dict[str, list[str]]:
    # each probed unit's dead ends, by name
    found: dict[str, list[str]] = {}
    probing = dead_ends.DeadEnds.probing

    @contextmanager
    def record(self, unit):
        with probing(self, unit):
            yield
        if self.enabled:
            names = {m: n for n, m in unit.module.named_modules()}
            found[unit.name] = sorted(names[m] for m in self.layers[unit])

    monkeypatch.setattr(dead_ends.DeadEnds, "probing", record)
    return found


def _same_as_full_recompute(module, precision: str = "32-true", accelerator: str = "cpu") -> None:
    kwargs = dict(precision=precision, steps=3, gradient_clip_val=0.5, accelerator=accelerator)
    ours, _ = fit(module, streamed(), **kwargs)
    full, _ = fit(module, streamed(engine=EngineConfig(skip_dead_ends=False)), **kwargs)
    start = module.state_dict()
    assert all(torch.equal(ours[k], full[k]) for k in full)
    assert all(not torch.equal(ours[k], start[k].float()) for k in full if "blocks" in k or "layers" in k)


@pytest.mark.parametrize(
    ("how", "dead"),
    [
        ("plain", ["out"]),
        ("strided", ["out"]),
        ("bias", ["out"]),
        ("patched", []),
        ("dropout", []),
        ("branch", []),
        ("in-place", []),
        ("scaled", []),
    ],
)
def test_only_the_layers_whose_product_only_a_residual_addition_reads_are_left_out(monkeypatch, how, dead):
    found = _found(monkeypatch)
    for precision in ("32-true", "bf16-mixed"):
        _same_as_full_recompute(_BlocksLM(how), precision)
    assert {name: layers for name, layers in found.items() if "blocks" in name} == {
        f"net.blocks.{i}": dead for i in range(3)
    }


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["plain", "bias"])
def test_on_cuda_the_products_left_out_train_the_same_bits(monkeypatch, how):
    # bf16 products of cuBLAS under autocast (toy blocks: no attention, whose cuDNN backward may add in any order)
    found = _found(monkeypatch)
    _same_as_full_recompute(_BlocksLM(how), "bf16-mixed", "gpu")
    assert [found[f"net.blocks.{i}"] for i in range(3)] == [["out"]] * 3


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_llama_blocks_leave_out_their_down_projection_and_train_as_with_the_full_recompute(monkeypatch, precision):
    found = _found(monkeypatch)
    calls = []
    forward = dead_ends._DeadLinear.forward
    monkeypatch.setattr(dead_ends._DeadLinear, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))
    _same_as_full_recompute(CausalLM(tiny_config("llama")), precision)
    assert {name: layers for name, layers in found.items() if ".layers." in name} == {
        f"model.model.layers.{i}": ["mlp.down_proj"] for i in range(4)
    }
    assert len(calls) == 4 * 3  # every block's recompute, every step


def test_a_lora_base_layer_is_left_out_and_its_adapter_trains_as_with_the_full_recompute(monkeypatch):
    from peft import LoraConfig, get_peft_model

    found = _found(monkeypatch)
    module = CausalLM(tiny_config("llama"))
    module.model = get_peft_model(module.model, LoraConfig(r=4, target_modules=["down_proj", "q_proj"]))
    for name, p in module.model.named_parameters():  # peft starts B at zero
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    kwargs = dict(steps=3)
    ours, _ = fit(module, streamed(), **kwargs)
    full, _ = fit(module, streamed(engine=EngineConfig(skip_dead_ends=False)), **kwargs)
    assert all(torch.equal(ours[k], full[k]) for k in full)
    assert any("lora" in k and not torch.equal(ours[k], module.state_dict()[k]) for k in ours)
    assert {name: layers for name, layers in found.items() if ".layers." in name} == {
        f"model.base_model.model.model.layers.{i}": ["mlp.down_proj.base_layer"] for i in range(4)
    }


def test_a_post_norm_block_leaves_out_nothing(monkeypatch):
    # Gemma 2 normalizes each branch's output before the residual addition: the norm reads the product
    from transformers import Gemma2Config

    found = _found(monkeypatch)
    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)  # fmt: skip
    fit(CausalLM(config), streamed(), steps=1)
    assert {name: layers for name, layers in found.items() if ".layers." in name} == {
        f"model.model.layers.{i}": [] for i in range(2)
    }
