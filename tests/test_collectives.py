"""The course's send/recv collectives equal torch's own ops (world sizes 1-6, uneven sizes, several dtypes and ops),
their byte counts equal the formulas of course_lib.costs.alpha_beta exactly, and their traces show the taught steps."""

import pytest
import torch

from course_lib import run

SIZES = (0, 1, 5, 7, 13, 64, 101)
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)


def _input(rank, n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=dtype)
    return torch.randint(-50, 50, (n,), generator=g, dtype=dtype)


def _compare_all(sizes, dtypes):
    """On every rank: each algorithm vs dist.all_reduce on the same inputs; returns the failures (empty = pass)."""
    import torch.distributed as dist

    from course_lib.collectives import ALL_REDUCE, Traffic

    rank, bad = dist.get_rank(), []
    for name, algo in ALL_REDUCE.items():
        for n in sizes:
            for dtype in dtypes:
                for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                    want = _input(rank, n, dtype, n)
                    dist.all_reduce(want, op=top)
                    got = _input(rank, n, dtype, n)
                    out = algo(got, op=op, traffic=Traffic())
                    ok = out is got and got.dtype == dtype and (
                        torch.allclose(got, want, rtol=1e-5, atol=1e-5) if dtype.is_floating_point
                        else torch.equal(got, want))
                    if not ok:
                        bad.append((name, n, str(dtype), op))
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6])
def test_all_reduce_algorithms_match_torch(world):
    sizes = SIZES if world <= 4 else (0, 1, 7, 101)
    res = run(_compare_all, world, args=(sizes, DTYPES), timeout=60, output="none")
    assert res.values == [[]] * world


def _ring_rs_ag(n):
    import torch.distributed as dist

    from course_lib.collectives import chunk_bounds, ring_all_gather, ring_reduce_scatter

    rank, p = dist.get_rank(), dist.get_world_size()
    x = _input(rank, n, torch.int64, 7)
    total = x.clone()
    dist.all_reduce(total)
    mine = ring_reduce_scatter(x.clone())
    lo, hi = chunk_bounds(n, p)[rank]
    sizes = [b - a for a, b in chunk_bounds(n, p)]
    gathered = ring_all_gather(mine, sizes=sizes)
    # non-contiguous input: every other element of a 2-D tensor's column
    base = _input(rank, 2 * n, torch.int64, 8).view(n, 2)
    col = base[:, 1]
    want_col = col.clone()
    dist.all_reduce(want_col)
    from course_lib.collectives import ring_all_reduce

    ring_all_reduce(col)
    return torch.equal(mine, total[lo:hi]), torch.equal(gathered, total), torch.equal(base[:, 1], want_col)


@pytest.mark.parametrize("world,n", [(2, 5), (3, 7), (4, 13), (5, 3)])
def test_ring_reduce_scatter_and_all_gather_uneven(world, n):
    res = run(_ring_rs_ag, world, args=(n,), timeout=60, output="none")
    assert res.values == [(True, True, True)] * world


def _traffic(n, dtype):
    import torch.distributed as dist

    from course_lib.collectives import ALL_REDUCE, Traffic

    out = {}
    for name, algo in ALL_REDUCE.items():
        t = Traffic()
        algo(torch.ones(n, dtype=dtype), traffic=t)
        out[name] = (t.bytes_sent, t.bytes_recv)
    return dist.get_rank(), out


@pytest.mark.parametrize("world,n", [(2, 12), (3, 12), (4, 12), (4, 10), (5, 7), (6, 12)])
def test_bytes_sent_equal_the_formulas(world, n):
    from course_lib.collectives import chunk_bounds
    from course_lib.costs.alpha_beta import allreduce_traffic, lg

    es = 4
    nbytes = n * es
    res = run(_traffic, world, args=(n, torch.float32), timeout=60, output="none")
    per_rank = dict(res.values)
    sizes = [b - a for a, b in chunk_bounds(n, world)]
    for name in ("ring", "tree", "recursive_doubling", "star"):
        sent = [per_rank[r][name][0] for r in range(world)]
        recv = [per_rank[r][name][1] for r in range(world)]
        f = allreduce_traffic(name, world, nbytes)
        assert sum(sent) == sum(recv) == f["total"], name
        assert max(sent) == pytest.approx(f["busiest"]) or (name == "ring" and n % world), name
    ring = [per_rank[r]["ring"][0] for r in range(world)]
    # exact per rank, any n: reduce-scatter skips chunk r, all-gather skips chunk r+1
    assert ring == [(2 * n - sizes[r] - sizes[(r + 1) % world]) * es for r in range(world)]
    if n % world == 0:
        assert ring == [2 * (world - 1) / world * nbytes] * world
    assert per_rank[0]["tree"][0] == lg(world) * nbytes            # the root broadcasts lg p times
    assert per_rank[0]["star"][0] == per_rank[0]["star"][1] == (world - 1) * nbytes


def _traced(algo_name, n):
    import torch.distributed as dist

    from course_lib.collectives import ALL_REDUCE, Trace

    rank = dist.get_rank()
    tr = Trace()
    ALL_REDUCE[algo_name](torch.full((n,), float(2**rank)), trace=tr)
    return tr


def test_ring_trace_shows_reduce_scatter_then_all_gather():
    from course_lib.collectives import merge

    p = 4
    steps = merge(run(_traced, p, args=("ring", 4), timeout=30, output="none").values)
    assert [s["phase"] for s in steps] == ["start"] + ["reduce-scatter"] * 3 + ["all-gather"] * 3
    # each step: every rank sends exactly one chunk to its right neighbour
    for s in steps[1:]:
        assert sorted((src, dst) for src, dst, _, _ in s["sends"]) == [(r, (r + 1) % p) for r in range(p)]
    # after reduce-scatter rank r owns the full sum (15) in chunk r; after all-gather everyone has it everywhere
    rs_end = steps[3]["buffers"]
    assert all(rs_end[r][r].item() == 15 for r in range(p))
    assert all(torch.equal(b, torch.full((4,), 15.0)) for b in steps[-1]["buffers"])


@pytest.mark.parametrize("name,phases", [("tree", 4), ("recursive_doubling", 2), ("star", 2)])
def test_other_traces_have_the_formula_step_counts(name, phases):
    from course_lib.collectives import merge

    steps = merge(run(_traced, 4, args=(name, 3), timeout=30, output="none").values)
    assert len(steps) == 1 + phases        # 2 lg p, lg p, 2 (start snapshot first)
    assert all(torch.equal(b, torch.full((3,), 15.0)) for b in steps[-1]["buffers"])


def test_tracing_off_records_nothing_and_costs_no_copies():
    import inspect

    from course_lib.collectives import ring

    # every trace use is behind `if trace is not None` (the snapshot clone happens only then)
    src = inspect.getsource(ring)
    assert src.count("trace.record(") == src.count("if trace is not None:\n            trace.record(")


def _segmented(n, seg_bytes):
    import torch.distributed as dist

    from course_lib.collectives import Traffic, ring, ring_all_reduce

    ring.SEGMENT_BYTES = seg_bytes          # this rank process only: small segments, many pieces per chunk
    x = _input(dist.get_rank(), n, torch.float64, 3)
    want = x.clone()
    dist.all_reduce(want)
    t = Traffic()
    ring_all_reduce(x, traffic=t)
    return torch.allclose(x, want), t.bytes_sent


@pytest.mark.parametrize("world,n", [(2, 7), (3, 13), (4, 101), (5, 3)])
def test_ring_in_segments_gives_the_same_result_and_bytes(world, n):
    from course_lib.collectives import chunk_bounds

    res = run(_segmented, world, args=(n, 16), timeout=60, output="none")   # 2 float64 per segment
    sizes = [b - a for a, b in chunk_bounds(n, world)]
    assert res.values == [(True, (2 * n - sizes[r] - sizes[(r + 1) % world]) * 8) for r in range(world)]
