"""Rabenseifner's all-reduce and the hierarchical all-reduce equal torch's own and a single-process sum (world sizes
2-8, sizes not divisible by p), send the bytes and take the steps of their formulas, and their traces and drawing
show the taught steps (notebooks/06_build_your_own_collectives.ipynb, sections 5 and 7)."""

import pytest
import torch

from course_lib import run

SIZES = (0, 1, 3, 7, 13, 64, 101)


def _input(rank, n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=dtype)
    return torch.randint(-50, 50, (n,), generator=g, dtype=dtype)


def _against_torch_and_one_process(algo_name, sizes, per_node=None):
    """On every rank: the algorithm vs dist.all_reduce and vs the sum of every rank's input in this one process."""
    import torch.distributed as dist

    from course_lib.collectives import hierarchical_all_reduce, rabenseifner_all_reduce

    rank, p = dist.get_rank(), dist.get_world_size()
    algo = (rabenseifner_all_reduce if algo_name == "rabenseifner"
            else lambda t, op="sum": hierarchical_all_reduce(t, per_node, op=op))
    bad = []
    for n in sizes:
        for dtype in (torch.float64, torch.float32, torch.int64):
            want = _input(rank, n, dtype, n)
            dist.all_reduce(want)
            one = sum(_input(r, n, dtype, n).double() for r in range(p))
            got = _input(rank, n, dtype, n)
            out = algo(got)
            if dtype.is_floating_point:
                # Summation order differs from torch's: p-1 additions of O(1) values, a few ulps of the dtype.
                tol = 8 * p * torch.finfo(dtype).eps
                ok = torch.allclose(got, want, rtol=tol, atol=tol) and torch.allclose(got.double(), one, rtol=tol,
                                                                                      atol=tol)
            else:
                ok = torch.equal(got, want) and torch.equal(got, one.to(dtype))
            if not (ok and out is got):
                bad.append((n, str(dtype)))
        mx = _input(rank, 5, torch.float32, 9)
        want = mx.clone()
        dist.all_reduce(want, op=dist.ReduceOp.MAX)
        algo(mx, op="max")
        if not torch.equal(mx, want):
            bad.append(("max", 5))
    return bad


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_rabenseifner_equals_torch_and_a_one_process_sum(world):
    sizes = SIZES if world in (2, 4) else (0, 1, 7, 101)
    res = run(_against_torch_and_one_process, world, args=("rabenseifner", sizes), timeout=90, output="none")
    assert res.values == [[]] * world


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4), (6, 3), (6, 2), (4, 1), (4, 4)])
def test_hierarchical_equals_torch_and_a_one_process_sum(world, per_node):
    res = run(_against_torch_and_one_process, world, args=("hierarchical", (0, 1, 7, 13, 101), per_node),
              timeout=90, output="none")
    assert res.values == [[]] * world


def _bytes(n):
    import torch.distributed as dist

    from course_lib.collectives import Traffic, rabenseifner_all_reduce

    t = Traffic()
    rabenseifner_all_reduce(torch.ones(n), traffic=t)
    return dist.get_rank(), t.bytes_sent, t.bytes_recv, t.messages_sent


@pytest.mark.parametrize("world,n", [(2, 12), (4, 12), (8, 16), (4, 10), (8, 5), (3, 12), (5, 8), (6, 12), (7, 9)])
def test_rabenseifner_bytes_and_messages_follow_the_formulas(world, n):
    from course_lib.collectives import chunk_bounds
    from course_lib.costs.alpha_beta import lg

    es, nbytes = 4, 4 * n
    rows = {r: (s, rv, m) for r, s, rv, m in run(_bytes, world, args=(n,), timeout=60, output="none").values}
    pof2 = 1 << (world.bit_length() - 1)
    rem = world - pof2
    sizes = [b - a for a, b in chunk_bounds(n, pof2)]
    sent = [rows[r][0] for r in range(world)]
    assert sum(sent) == sum(rows[r][1] for r in range(world))
    # the power of two sends 2(p'-1) n in all (every chunk crosses p'-1 links each way); a fold adds n each way
    assert sum(sent) == (2 * (pof2 - 1) + 2 * rem) * nbytes
    if rem == 0:
        # each phase sends p-1 chunks per rank (p/2 + p/4 + ... + 1, then 1 + 2 + ... + p/2), one message per step
        assert all(2 * (world - 1) * min(sizes) * es <= s <= 2 * (world - 1) * max(sizes) * es for s in sent)
        assert all(rows[r][2] <= 2 * lg(world) for r in range(world))
        if n % world == 0:
            assert sent == [2 * (world - 1) / world * nbytes] * world
            assert all(rows[r][2] == 2 * lg(world) for r in range(world))   # one message per step


def _traced(n):
    import torch.distributed as dist

    from course_lib.collectives import Trace, rabenseifner_all_reduce

    tr = Trace()
    rabenseifner_all_reduce(torch.full((n,), float(2 ** dist.get_rank())), trace=tr)
    return tr


def test_the_rabenseifner_trace_halves_then_doubles():
    from course_lib.collectives import merge

    p = 4
    traces = run(_traced, p, args=(4,), timeout=30, output="none").values
    steps = merge(traces)
    assert [s["phase"] for s in steps] == ["start", "halving", "halving", "doubling", "doubling"]
    assert sorted({(src, dst) for src, dst, _, _ in steps[1]["sends"]}) == [(r, r ^ 2) for r in range(p)]
    assert sorted({(src, dst) for src, dst, _, _ in steps[2]["sends"]}) == [(r, r ^ 1) for r in range(p)]
    assert all(steps[2]["buffers"][r][r].item() == 15 for r in range(p))      # rank r owns chunk r after halving
    assert all(torch.equal(b, torch.full((4,), 15.0)) for b in steps[-1]["buffers"])
    folded = merge(run(_traced, 6, args=(4,), timeout=30, output="none").values)
    assert [s["phase"] for s in folded] == ["start", "fold", "halving", "halving", "doubling", "doubling", "unfold"]
    assert all(torch.equal(b, torch.full((4,), 63.0)) for b in folded[-1]["buffers"])


def _traced_hierarchical(n, per_node):
    import torch.distributed as dist

    from course_lib.collectives import Trace, hierarchical_all_reduce

    tr = Trace()
    hierarchical_all_reduce(torch.full((n,), float(2 ** dist.get_rank())), per_node, trace=tr)
    return tr


def test_only_the_middle_phase_crosses_nodes_and_it_carries_a_shard():
    from course_lib.collectives import merge

    p, g, n = 8, 4, 16
    steps = merge(run(_traced_hierarchical, p, args=(n, g), timeout=60, output="none").values)
    assert [s["phase"] for s in steps] == (["start"] + ["in-node reduce-scatter"] * (g - 1)
                                           + ["all-reduce across nodes"] + ["in-node all-gather"] * (g - 1))
    for s in steps:
        crossing = [(src, dst, b) for src, dst, _, b in s["sends"] if src // g != dst // g]
        if s["phase"] == "all-reduce across nodes":
            nodes = p // g
            # a ring all-reduce of a shard of n/g elements among N nodes: 2(N-1)/N of it, float32
            assert sorted((src, dst) for src, dst, _ in crossing) == [(r, (r + g) % p) for r in range(p)]
            assert all(b == 2 * (nodes - 1) / nodes * (n // g) * 4 for _, _, b in crossing)
        else:
            assert crossing == []
    assert all(torch.equal(b, torch.full((n,), 255.0)) for b in steps[-1]["buffers"])


def _refused():
    from course_lib.collectives import hierarchical_all_reduce

    try:
        hierarchical_all_reduce(torch.ones(3), per_node=2)
    except ValueError as e:
        return str(e)
    return None


def test_hierarchical_refuses_ranks_that_do_not_fill_whole_nodes():
    assert all("whole number of nodes" in v for v in run(_refused, 3, timeout=30, output="none").values)


def test_the_hierarchical_drawing_marks_the_nodes_and_draws_one_arrow_per_send():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.viz.hierarchical import plot_hierarchical

    bufs = [torch.full((4,), float(2 ** r)) for r in range(4)]
    steps = [{"phase": "start", "sends": [], "buffers": bufs},
             {"phase": "across", "sends": [(0, 2, 0, 4), (2, 0, 0, 4), (1, 3, 1, 4), (3, 1, 1, 4)], "buffers": bufs}]
    fig = plot_hierarchical(steps, [(0, 2), (2, 4)], per_node=2, cols=2)
    first, second = fig.axes[:2]
    assert [len(ax.lines) for ax in (first, second)] == [1, 1]          # one node boundary each
    arrows = [t for t in second.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == 4
    plt.close(fig)
