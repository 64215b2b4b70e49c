"""Rank functions for ``test_multi_rank.py``, in a module of their own: each rank process imports only
this and torch, not the test module's sglang test utilities (seconds per rank on a busy CPU)."""

import torch
import torch.distributed as dist


def sum_of_ranks(rank, world_size, offset):
    total = torch.tensor(rank + offset)
    dist.all_reduce(total)
    return rank, world_size, int(total), torch.get_num_threads()


def rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.tensor(0))  # rank 1 never joins: this must fail, not hang
    return "unreachable"
