"""A streamed block's forward keeps its attention outputs and its backward's replay skips the attention's forward
(engine/kept_attention.py): the same training as the full replay, within the room the plan leaves."""

import pytest
import torch

import lightning_slide.engine.kept_attention as kept_attention
from helpers import CausalLM, fit, global_error, streamed, tiny_config
from lightning_slide.engine.config import EngineConfig
from lightning_slide.kernels.attention import FlashKernel


def _llama(**overrides):
    return CausalLM(tiny_config("llama", hidden_size=64, intermediate_size=128, head_dim=16, **overrides))


def _count_forwards(monkeypatch) -> dict[str, int]:
    # the attention kernels' forwards, and the replays that took a kept output instead
    counts = {"forward": 0, "replayed": 0}
    forward, replayed = FlashKernel.forward, kept_attention._Replayed.forward

    def counted_forward(self, *args):
        counts["forward"] += 1
        return forward(self, *args)

    def counted_replay(*args):
        counts["replayed"] += 1
        return replayed(*args)

    monkeypatch.setattr(FlashKernel, "forward", counted_forward)
    monkeypatch.setattr(kept_attention._Replayed, "forward", staticmethod(counted_replay))
    return counts


def test_the_replay_takes_the_kept_outputs_and_trains_the_same_bits(monkeypatch):
    # fp32: the kernels run under TRITON_INTERPRET=1 (its bf16 is unreliable); bf16 on CUDA below
    counts = _count_forwards(monkeypatch)
    module = _llama(layers=2)
    kwargs = dict(steps=2, gradient_clip_val=0.5)
    ours, _ = fit(module, streamed(attention="slide_kernel", num_slots=2), **kwargs)
    assert counts == {"forward": 2 * 2, "replayed": 2 * 2}  # one forward per block and step, none in the backward
    config = EngineConfig(keep_attention=False)
    full, _ = fit(module, streamed(attention="slide_kernel", num_slots=2, engine=config), **kwargs)
    assert counts == {"forward": 2 * 2 + 2 * 2 * 2, "replayed": 2 * 2}
    start = module.state_dict()
    assert all(torch.equal(ours[k], full[k]) for k in full)
    assert all(not torch.equal(ours[k], start[k]) for k in full if "layers" in k)


@pytest.mark.slow
def test_packed_documents_keep_their_outputs_too(monkeypatch):
    # position ids that restart: the variable-length kernel, its sequences kept with the call
    counts = _count_forwards(monkeypatch)
    module = _llama(layers=2)

    class Packed(type(module)):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            positions = torch.arange(ids.shape[1]).remainder(ids.shape[1] // 2).expand_as(ids)  # two documents a row
            return self.model(input_ids=ids, labels=ids, position_ids=positions).loss

    packed = Packed(module.model.config)
    packed.load_state_dict(module.state_dict())
    ours, _ = fit(packed, streamed(attention="slide_kernel"), steps=2)
    full, _ = fit(packed, streamed(attention="slide_kernel", engine=EngineConfig(keep_attention=False)), steps=2)
    assert counts["replayed"] == 2 * 2
    assert all(torch.equal(ours[k], full[k]) for k in full)


@pytest.mark.slow
def test_blocks_beyond_the_room_replay_their_attention(monkeypatch, caplog):
    # room for two blocks' outputs of four: the others run their attention's forward again in the backward
    counts = _count_forwards(monkeypatch)
    keep = kept_attention.KeptAttention.keep

    def with_room(self, unit, records):
        if records and not self.keeps:
            self.room = 2 * kept_attention._nbytes(records)
        return keep(self, unit, records)

    monkeypatch.setattr(kept_attention.KeptAttention, "keep", with_room)
    module = _llama()
    with caplog.at_level("INFO", logger=kept_attention.__name__):
        ours, _ = fit(module, streamed(attention="slide_kernel"), steps=2)
    assert counts == {"forward": 4 * 2 + 2 * 2, "replayed": 2 * 2}
    assert "keeps the attention outputs of 2 blocks" in caplog.text
    full, _ = fit(module, streamed(attention="slide_kernel", engine=EngineConfig(keep_attention=False)), steps=2)
    assert all(torch.equal(ours[k], full[k]) for k in full)


def test_a_replay_that_calls_other_attention_than_its_forward_is_an_error():
    kernel = FlashKernel(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([[0], [4]], dtype=torch.int32), None)
    q = torch.zeros(4, 2, 16)
    records = [(torch.zeros(4, 2, 16), ())]
    with kept_attention.KeptAttention.replaying(records):
        kept_attention.through()(kernel, q, q, q)
        with pytest.raises(RuntimeError, match="replayed other attention calls than its forward ran"):
            kept_attention.through()(kernel, q, q, q)  # a second call the forward did not make
    with kept_attention.KeptAttention.replaying(records), pytest.raises(RuntimeError, match="keep_attention=False"):
        kept_attention.through()(kernel, torch.zeros(4, 4, 16), q, q)  # another shape
    assert kept_attention.through() is None


def test_engine_config_refuses_a_keep_attention_that_is_not_a_bool():
    with pytest.raises(ValueError, match="keep_attention"):
        EngineConfig(keep_attention="auto")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["slide", "slide_kernel"])
def test_on_cuda_the_kept_outputs_train_as_the_full_replay(attention):
    # bf16: "slide" takes cuDNN's attention for these dense batches (its backward may add in any order: within
    # twice plain bf16's error of fp32), "slide_kernel" the project's kernel (the same bits)
    module = CausalLM(tiny_config("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2))  # fmt: skip
    kwargs = dict(accelerator="gpu", precision="bf16-mixed", steps=3)
    ours, _ = fit(module, streamed(attention=attention), **kwargs)
    full, _ = fit(module, streamed(attention=attention, engine=EngineConfig(keep_attention=False)), **kwargs)
    if attention == "slide_kernel":
        assert all(torch.equal(ours[k], full[k]) for k in full)
    else:
        ref32, _ = fit(module, "auto", accelerator="gpu", steps=3)
        plain16, _ = fit(module, "auto", accelerator="gpu", precision="bf16-mixed", steps=3)
        assert global_error(ours, ref32) <= 2 * global_error(plain16, ref32)
