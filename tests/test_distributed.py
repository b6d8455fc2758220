"""Two processes with DistributedDataParallel (gloo, CPU) train exactly like one process on the whole batch."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from annotated_transformer.model import make_model
from annotated_transformer.checkpoints import load_checkpoint
from annotated_transformer.folders import latest_checkpoint
from annotated_transformer.trainer import train
from annotated_transformer.training import Batch, LabelSmoothing, make_scheduler

CONFIG = dict(src_vocab=11, tgt_vocab=11, N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
STEPS = 3


def batches():
    """Global batches of 6 rows with uneven padding, so the two halves hold different numbers of tokens."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        data = torch.randint(2, 11, (6, 7), generator=generator)
        data[:, 0] = 1
        for row in range(6):
            data[row, int(torch.randint(2, 8, (1,), generator=generator)):] = 0
        out.append(Batch(data, data.clone(), pad=0))
    return out


def run(checkpoint_dir=None, time_limit=None):
    torch.manual_seed(0)
    model = make_model(**CONFIG).double()
    # SGD: the update is proportional to the gradient, so equal weights mean equal gradients.
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = make_scheduler(optimizer, 16, warmup=2)
    history = train(model, batches(), steps=STEPS, optimizer=optimizer, scheduler=scheduler,
                    loss_fn=LabelSmoothing(11, 0, 0.1), accumulation_steps=2, device="cpu",
                    checkpoint_dir=checkpoint_dir, progress=False, time_limit=time_limit)
    return model, history


def worker(rank, world, port, folder, limits=(None, None)):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, history = run(checkpoint_dir=folder, time_limit=limits[rank])
        torch.save({"state": model.state_dict(), "loss": history["loss"]}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    reference, history = run()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, value in reference.state_dict().items():
        for result in results:
            assert torch.allclose(result["state"][name], value, rtol=0, atol=1e-12), name
    for result in results:  # the logged loss is the whole batch's loss per token on every process
        assert torch.allclose(torch.tensor(result["loss"]), torch.tensor(history["loss"]), rtol=1e-12)
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path))
    assert checkpoint["step"] == STEPS and len(checkpoint["rng"]) == 2  # one generator state per process


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_first_process_clock_ends_a_time_limited_run_for_both(tmp_path):
    # rank 0 is out of time after its first step, rank 1 never: both must stop there (a rank that went on alone
    # would wait for the other in its next all-reduce, and the test would hang)
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), (0.0, float("inf"))), nprocs=2, join=True)
    reference, history = run(time_limit=0.0)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert len(history["loss"]) == 1 and all(len(result["loss"]) == 1 for result in results)
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1
