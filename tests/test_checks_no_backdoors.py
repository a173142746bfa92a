"""Every way into the answer an exercise asks for stays shut while the learner's code runs: the private halves of the
course's own collectives (4.2, 4.3, 6.1), every library function that returns a ring's bytes (6.2, 10.1), torch's
own DDP (9.2), the course's loss scaler (14b.1), gossip's neighbour tables (11.2) and the
tensor-parallel layers' constructors (13.1); each refusal names what was switched off."""

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.algorithms import check_ring_all_reduce, check_ring_bytes_prediction
from course_lib.checks.core import ExerciseFailed
from course_lib.checks.decentralized import check_one_peer_gossip
from course_lib.checks.loss_scaling import check_loss_scaling
from course_lib.checks.primitives import check_all_gather, check_broadcast
from course_lib.checks.reducer import check_reducer_with_unused_parameters
from course_lib.checks.tensor_parallel import check_column_parallel_forward
from course_lib.checks.training import check_ring_bytes


def _refused(what: str) -> str:
    return rf"{what} \(it holds the answer\) is switched off"


def gather_by_the_courses_half(t):
    from course_lib.collectives import ring

    p, n = dist.get_world_size(), t.numel()
    flat = torch.zeros(p * n, dtype=t.dtype)
    flat[dist.get_rank() * n:(dist.get_rank() + 1) * n] = t.view(-1)
    ring._all_gather(flat, ring.chunk_bounds(p * n, p), None, None)
    return list(flat.view(p, *t.shape))


def broadcast_by_the_courses_half(t, src):
    from course_lib.collectives import tree

    tree._broadcast(t.view(-1), src, None, None)
    return t


def ring_by_the_courses_halves(t):
    from course_lib.collectives import ring

    flat = t.view(-1)
    bounds = ring.chunk_bounds(flat.numel(), dist.get_world_size())
    ring._reduce_scatter(flat, bounds, "sum", None, None)
    ring._all_gather(flat, bounds, None, None)
    return t


def test_the_private_halves_of_the_courses_collectives_are_off():
    with pytest.raises(ExerciseFailed, match=_refused(r"collectives\.ring\._all_gather")):
        check_all_gather(gather_by_the_courses_half)
    with pytest.raises(ExerciseFailed, match=_refused(r"collectives\.tree\._broadcast")):
        check_broadcast(broadcast_by_the_courses_half)
    with pytest.raises(ExerciseFailed, match=_refused(r"collectives\.ring\._reduce_scatter")):
        check_ring_all_reduce(ring_by_the_courses_halves, world_sizes=(2,), sizes=(4,))


def test_no_library_function_gives_a_rings_bytes():
    from course_lib.training import compression, zero

    with pytest.raises(ExerciseFailed, match=_refused(r"training\.compression\.ring_sent_bytes")):
        check_ring_bytes_prediction(lambda rank, p, n: compression.ring_sent_bytes(n, p, rank))
    with pytest.raises(ExerciseFailed, match=_refused(r"training\.compression\.ring_sent_bytes")):
        check_ring_bytes(lambda n, m: compression.ring_sent_bytes(m // 4, n, 0))
    with pytest.raises(ExerciseFailed, match=_refused(r"training\.zero\.ring_bytes_formula")):
        check_ring_bytes(lambda n, m: zero.ring_bytes_formula("DP", [(m // 4,)], n))


class ReducerByTorchsOwn:                  # exercise 9.2 answered by torch's DDP and its unused-parameter search
    def __init__(self, model, bucket_bytes):
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model, find_unused_parameters=True)


def test_torchs_own_ddp_is_off_in_the_reducer_exercise():
    with pytest.raises(ExerciseFailed, match=r"Exercise 9\.2 is about a reducer whose buckets survive a parameter "
                                             r"without a gradient; torch's DistributedDataParallel is switched off"):
        check_reducer_with_unused_parameters(ReducerByTorchsOwn)


def step_by_the_courses_scaler(stage, lr, scaler):
    from course_lib.training.mixed_precision import LossScaler

    LossScaler(scaler["scale"], growth_interval=scaler["growth_interval"]).update(False)


def gossip_by_the_courses_table(x, t):
    from course_lib.training import gossip

    gossip.out_neighbours("one-peer exponential", dist.get_world_size(), dist.get_rank(), t)
    return x


def column_by_the_courses_layer(x, linear):
    from course_lib.training.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear(linear)(x)


def test_the_courses_own_scaler_neighbour_table_and_layers_are_off():
    with pytest.raises(ExerciseFailed, match=_refused(r"training\.mixed_precision\.LossScaler\.update")):
        check_loss_scaling(step_by_the_courses_scaler)
    with pytest.raises(ExerciseFailed, match=_refused(r"training\.gossip\.out_neighbours")):
        check_one_peer_gossip(gossip_by_the_courses_table)
    with pytest.raises(ExerciseFailed, match=_refused(r"training\.tensor_parallel\.ColumnParallelLinear\.__init__")):
        check_column_parallel_forward(column_by_the_courses_layer)
