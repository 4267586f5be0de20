"""The memory a node's processes share (``engine/shared_host.py``), in one process: the row shares, the mapped files,
and pinning them for the GPU. Several processes: ``test_data_parallel.py``."""

import datetime
import glob
import socket

import pytest
import torch
import torch.distributed as dist

from lightning_slide.engine.shared_host import SHM, SharedHost, drop_weights
from lightning_slide.engine.transfer import Transfer


@pytest.fixture
def shared():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield SharedHost(0, 1, timeout=datetime.timedelta(seconds=60))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("rows", [1, 4, 7, 130])
def test_the_processes_rows_cover_each_parameter_once(size, rows):
    shares = []
    for rank in range(size):
        host = SharedHost.__new__(SharedHost)
        host.rank, host.size = rank, size
        shares.append(host.rows(torch.empty(rows, 3)))
        assert host.rows(torch.empty(())) == (None if rank == 0 else slice(0, 0))  # a scalar: the first process's
    assert [s.start for s in shares] == [0] + [s.stop for s in shares[:-1]]
    assert shares[-1].stop == rows
    assert all(s.stop - s.start == -(-rows // size) for s in shares if s.stop < rows)  # equal shares, the last short


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_process_dropping_its_weights_keeps_each_parameter_but_no_memory(device):
    # a node's process but its first, before the plan: what it loaded goes (or, built on the meta device, it never had
    # any); the parameter objects stay (ties, attributes), and a later view of shared memory can take their place
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        model[0].register_buffer("table", torch.ones(3))
    model[1].weight = model[0].weight
    model[0].weight.marked = True
    model[1].requires_grad_(True)
    params = list(model.parameters())
    drop_weights(model)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert model[1].weight is model[0].weight
    assert params[0].marked
    assert params[0].requires_grad
    assert params[0].shape == (50, 8)
    assert params[0].device.type == "cpu"
    assert params[0].untyped_storage().nbytes() == 4
    assert model[0].table.device.type == "cpu"
    assert model[0].table.shape == (3,)
    params[0].data = torch.arange(400.0).view(50, 8)
    assert model[1].weight[1, 0] == 8


def test_the_shared_tensors_are_zeros_of_whole_pages_whose_names_are_gone(shared):
    a, b = shared.tensors([(10, torch.float32), (5000, torch.bfloat16)])
    assert a.shape == (10,)
    assert b.dtype == torch.bfloat16
    assert b.shape == (5000,)
    assert not a.any()
    assert not b.any()
    assert a.data_ptr() % 4096 == 0
    assert b.data_ptr() % 4096 == 0
    assert not glob.glob(f"{SHM}/lightning-slide-*")  # unlinked: the memory goes with the last process
    assert shared.sum(2.5) == 2.5
    assert shared.all_true(True)
    assert not shared.all_true(False)


def test_too_little_shared_memory_is_refused_before_anything_is_made(shared, monkeypatch):
    from lightning_slide.engine import shared_host

    monkeypatch.setattr(shared_host, "_shm_free", lambda: 1 << 20)
    with pytest.raises(MemoryError, match=r"needs 4.00 MiB but has 1.00 MiB free. Enlarge /dev/shm"):
        shared.tensors([(1 << 20, torch.float32)])
    assert not glob.glob(f"{SHM}/lightning-slide-*")


@pytest.mark.gpu
def test_masters_in_shared_memory_are_pinned_and_go_up(shared):
    device = torch.device("cuda")
    transfer = Transfer(device, chunk_numel=1 << 16, landing_buffers=1)
    params = [torch.nn.Parameter(torch.randn(300, 70)), torch.nn.Parameter(torch.randn(70))]
    values = [p.detach().clone() for p in params]
    (flat,) = shared.tensors([(sum(p.numel() for p in params), torch.float32)])
    transfer.pin(params, flat)
    assert all(p.data_ptr() >= flat.data_ptr() for p in params)
    assert flat.is_pinned()
    out = [torch.empty(p.shape, dtype=torch.bfloat16, device=device) for p in params]
    transfer.wait(transfer.upload(list(zip((p.data for p in params), out)), None))
    for o, v in zip(out, values):
        torch.testing.assert_close(o.float().cpu(), v.bfloat16().float())
    transfer.close()
