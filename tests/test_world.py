"""The gradients' average over processes (``engine/world.py``), on gloo: its collectives run while the training thread
goes on, and each process gets the mean of its rows. The training runs: ``test_data_parallel.py``."""

import time

import forked_runs
import pytest
import torch
import torch.distributed as dist

from lightning_slide.engine.world import DataParallel

LATE_S = 1.5  # how long the second process waits before it averages


def _in_processes(target, size: int) -> list:
    port = forked_runs.free_port()
    results = forked_runs.FORKS.SimpleQueue()
    forked_runs.start_processes(target, (size, port, results), size)
    return sorted(results.get() for _ in range(size))


def _join(rank: int, size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def _average_late(rank: int, size: int, port: int, results) -> None:
    _join(rank, size, port)
    world = DataParallel()
    grads = {0: torch.full((64, 8), float(rank + 1)), 1: torch.full((3,), float(rank), dtype=torch.bfloat16)}
    if rank == 1:
        time.sleep(LATE_S)
    start = time.perf_counter()
    means, wait = world.average(grads, "block")
    returned = time.perf_counter() - start
    wait()
    waited = time.perf_counter() - start
    results.put((rank, returned, waited, means[0].unique().tolist(), means[1].dtype, means[1].tolist()))
    dist.destroy_process_group()


def test_the_average_starts_and_the_training_thread_goes_on_until_it_is_read():
    (_, returned, waited, dense, dtype, low), second = _in_processes(_average_late, 2)
    assert returned < LATE_S / 3  # the first process did not wait for the second one's gradients
    assert waited > LATE_S / 2  # its wait did
    assert dense == second[3] == [1.5]
    assert (dtype, low) == (torch.float32, [0.5] * 3)  # a bf16 gradient is summed in fp32, as DDP's fp32 ones


def _split_over_nodes(rank: int, size: int, port: int, results) -> None:
    _join(rank, size, port)
    world = DataParallel(local_size=2)  # 2 nodes of 2 processes
    grad = torch.arange(10.0).view(5, 2) * (rank + 1)  # 5 rows: shares of 3 and 2, padded to equal ones
    means, wait = world.average({0: grad.to(torch.bfloat16), 1: grad.clone()}, "block", split={0, 1})
    wait()
    results.put((rank, means[0].tolist(), means[1].tolist()))
    dist.destroy_process_group()


@pytest.mark.slow  # (4 processes; the same path trains in test_two_nodes_each_holding_the_state_once_train_as_ddp)
def test_each_process_gets_the_mean_of_its_rows_across_nodes():
    mean = (torch.arange(10.0).view(5, 2) * 2.5).tolist()  # ranks 0-3 scaled the rows by 1-4
    for rank, low, dense in _in_processes(_split_over_nodes, 4):
        own = (torch.arange(10.0).view(5, 2) * (rank + 1)).tolist()
        mine = slice(0, 3) if rank % 2 == 0 else slice(3, 5)  # its local rank's share
        expected = [mean[r] if mine.start <= r < mine.stop else own[r] for r in range(5)]
        assert low == dense == expected, rank
