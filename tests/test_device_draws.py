"""A random init made on the CPU under the strategy draws from the GPU's generator, as plain Lightning's does."""

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import initialization as hf_init

from helpers import tiny_config
from lightning_slide.device_draws import DrawOnDevice


class _OwnGenerator(DrawOnDevice):
    """Draws on the CPU, from a generator state of its own: a CPU stand-in for the GPU's generator."""

    def __init__(self, seed: int) -> None:
        super().__init__(torch.device("cpu"))
        self.state = torch.Generator().manual_seed(seed).get_state()

    def _fill(self, func, drawn, args, kwargs):
        outer = torch.random.get_rng_state()
        torch.random.set_rng_state(self.state)
        func(drawn, *args, **kwargs)
        self.state = torch.random.get_rng_state()
        torch.random.set_rng_state(outer)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_every_random_fill_of_a_model_goes_to_the_device_generator(family):
    config = tiny_config(family, tied=family == "qwen3")
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(config)  # every draw from the generator seeded 1
    torch.manual_seed(0)
    untouched = torch.random.get_rng_state()
    with torch.device("cpu"), _OwnGenerator(seed=1):
        ours = AutoModelForCausalLM.from_config(config)
    assert torch.equal(torch.random.get_rng_state(), untouched)  # nothing drawn from the CPU's generator
    expected = reference.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items())


def test_explicit_generators_and_initialised_weights_are_left_alone():
    weight = torch.zeros(8)
    weight._is_hf_initialized = True
    generator = torch.Generator().manual_seed(3)
    with _OwnGenerator(seed=1):
        hf_init.normal_(weight)  # transformers' flag: a loaded weight is not drawn again
        drawn = torch.empty(8).normal_(generator=generator)
    assert not weight.any()
    assert torch.equal(drawn, torch.empty(8).normal_(generator=torch.Generator().manual_seed(3)))


@pytest.mark.gpu
def test_a_seeded_random_init_is_plain_lightnings():
    # configure_model runs under the strategy's tensor_init_context: plain Lightning's draws on the GPU
    def build(strategy):
        torch.manual_seed(0)
        torch.cuda.manual_seed(0)
        with strategy.tensor_init_context():
            model = AutoModelForCausalLM.from_config(tiny_config("qwen3", tied=True))
        devices = {p.device.type for p in model.parameters()}
        # the CPU generator's next draws: a DataLoader's shuffle reads them
        return {k: v.cpu() for k, v in model.state_dict().items()}, devices, torch.rand(4)

    plain, plain_devices, plain_next = build(L.Trainer(accelerator="gpu", devices=1, logger=False).strategy)
    ours, our_devices, our_next = build(L.Trainer(strategy="slideformer", accelerator="gpu", logger=False).strategy)
    assert plain_devices == {"cuda"}
    assert our_devices == {"cpu"}
    assert plain.keys() == ours.keys()
    assert all(torch.equal(plain[k], ours[k]) for k in plain), [k for k in plain if not torch.equal(plain[k], ours[k])]
    assert torch.equal(plain_next, our_next)
