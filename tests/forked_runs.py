"""A test's processes forked from one Python that has imported torch, Lightning and transformers once
(``multiprocessing``'s fork server): a data-parallel run of a test script, a script to be killed, a function in
several processes.

``python script.py`` spends ~7 s of CPU importing them in every process of every run, most of a two-process CPU run
of a tiny model; on a 2-core CI machine the data-parallel tests were half of the ``slow`` suite's time. A forked
process starts with them imported. The processes are started as a scheduler (SLURM, ``torchrun``) starts them: each
with the rank variables set, so Lightning's launcher starts none. ``tests/test_data_parallel.py`` runs the script as a
user does too, Lightning's launcher starting the other processes.
"""

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

import torch.multiprocessing as torch_multiprocessing

from helpers import USER_ENV

FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(["torch", "torch.distributed", "lightning", "transformers.models.llama.modeling_llama"])


def run(script: str, *args: str, processes: int, nodes: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python script *args`` in each of ``processes`` forked processes on each of ``nodes`` (all on this machine)
    of one world; their outputs, rank by rank, and the first non-zero exit code among them (as ``subprocess.run``
    gives them)."""
    start_server()
    size = processes * nodes
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(size)}
    with tempfile.TemporaryDirectory() as logs:
        started = []
        for rank in range(size):
            ranks = {"NODE_RANK": str(rank // processes), "LOCAL_RANK": str(rank % processes)}
            env = {**USER_ENV, **world, **ranks} if size > 1 else USER_ENV
            started.append(FORKS.Process(target=_main, args=(script, args, env, os.path.join(logs, str(rank)))))
            started[-1].start()
        deadline = time.monotonic() + timeout
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in started):
            for process in started:
                process.kill()
            raise subprocess.TimeoutExpired([script, *args], timeout)
        out, err = ("".join(_read(os.path.join(logs, f"{rank}.{kind}")) for rank in range(size)) for kind in
                    ("out", "err"))  # fmt: skip
    code = next((p.exitcode for p in started if p.exitcode), 0)
    return subprocess.CompletedProcess([script, *args], code, out, err)


def start_processes(target, args: tuple, processes: int) -> None:
    """``target(rank, *args)`` in each of ``processes`` forked processes (``torch.multiprocessing.start_processes``);
    a queue among ``args`` comes from ``FORKS``."""
    start_server()
    torch_multiprocessing.start_processes(target, args, nprocs=processes, start_method="forkserver")


def start_server() -> None:
    # the server's imports see the environment the runs have (no TRITON_INTERPRET, as a user's shell)
    with mock.patch.dict(os.environ, USER_ENV, clear=True):
        multiprocessing.forkserver.ensure_running()


def _main(script: str, args: tuple[str, ...], env: dict[str, str], log: str) -> None:
    # in the forked process: the script as __main__, its outputs to files, then the exit a finished Python makes
    os.environ.clear()
    os.environ.update(env)
    for fd, kind in ((1, "out"), (2, "err")):
        file = os.open(f"{log}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # as Python exits: sys.exit("message") prints it and gives 1
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a multiprocessing child skips them; the script's process would run them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
