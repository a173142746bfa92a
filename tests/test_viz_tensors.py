"""Per-rank tensor grids coloured by provenance recorded from a real run, never by matching values."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_lib import run  # noqa: E402
from course_lib.collectives.origins import sources  # noqa: E402
from course_lib.viz.tensors import (  # noqa: E402
    MIXED,
    PALETTE,
    REDUCED,
    UNWRITTEN,
    before_after,
    colours_from_origins,
    rank_colours,
    rank_panels,
)

W = 4


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def _cell(ax, i, r, n_rows):
    """The patches drawn for element i of rank r: (fill rectangle, hatch overlay or None)."""
    here = [p for p in ax.patches if p.get_xy() == (i, n_rows - 1 - r + 0.08)]
    fill = next(p for p in here if p.get_fill())
    hatch = next((p for p in here if not p.get_fill() and p.get_hatch()), None)
    return fill, hatch


def test_sources_decode_the_bits_of_a_tag():
    width = 3
    assert sources(0, width) == []
    assert sources(1 << (2 * width + 1), width) == [(2, 1)]
    assert sources((1 << 0) | (1 << 4) | (1 << 8), width) == [(0, 0), (1, 1), (2, 2)]


def _colliding_cases():
    """Every rank: real collectives on values that collide on purpose, each with its recorded provenance."""
    import torch.distributed as dist

    from course_lib.collectives.origins import origins, winners

    rank, p = dist.get_rank(), dist.get_world_size()
    out = {}

    # all_reduce SUM: rank 0 holds 10 and the sum is 10 as well.
    x = torch.tensor([[10, 3], [-4, 1], [4, 0], [0, 2]][rank])

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    out["all_reduce"] = (x.clone(), all_reduce(x.clone()), origins(all_reduce, x))

    # broadcast from 0: rank 2 already holds rank 0's values before the call.
    x = torch.tensor([7, 8]) if rank in (0, 2) else torch.tensor([rank, rank])

    def broadcast(t):
        dist.broadcast(t, src=0)
        return t

    out["broadcast"] = (x.clone(), broadcast(x.clone()), origins(broadcast, x))

    # all_gather_single: every rank holds the same value 5.
    x = torch.tensor([5])

    def all_gather(t, out_buf):
        dist.all_gather_single(out_buf, t)
        return out_buf

    out["all_gather"] = (x.clone(), all_gather(x.clone(), torch.empty(p, dtype=x.dtype)),
                         origins(all_gather, x, torch.empty(p, dtype=x.dtype)))

    # reduce_scatter_single: chunk j of every rank is summed onto rank j.
    x = torch.arange(2 * p) + 10 * rank

    def reduce_scatter(t, out_buf):
        dist.reduce_scatter_single(out_buf, t)
        return out_buf

    out["reduce_scatter"] = (x.clone(), reduce_scatter(x.clone(), torch.empty(2, dtype=x.dtype)),
                             origins(reduce_scatter, x, torch.empty(2, dtype=x.dtype)))

    # send/recv on ranks 0 -> 1 only: ranks 2, 3 keep zeros they were never sent.
    x = torch.tensor([1.0, 2.0]) if rank == 0 else torch.zeros(2)

    def one_message(t):
        if rank == 0:
            dist.send(t, dst=1)
        elif rank == 1:
            dist.recv(t, src=0)
        return t

    out["send_recv"] = (x.clone(), one_message(x.clone()), origins(one_message, x))

    # MAX with a tie: ranks 1 and 3 both hold the maximum 9 at element 0.
    x = torch.tensor([[1, 4], [9, 0], [3, 2], [9, 1]][rank])
    mx = x.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    out["max"] = (x.clone(), mx, winners(x, mx))
    return out


@pytest.fixture(scope="module")
def cases():
    return run(_colliding_cases, W, timeout=60, output="none").values


def _split(cases, name):
    before, after, tags = zip(*(c[name] for c in cases))
    return list(before), list(after), list(tags)


def test_a_sum_equal_to_one_rank_value_is_not_given_that_rank_colour(cases):
    before, after, tags = _split(cases, "all_reduce")
    assert all(a.tolist() == [10, 6] for a in after) and before[0].tolist()[0] == 10   # the collision is real
    ids, combined = colours_from_origins(rank_colours(before), tags, width=2)
    assert ids == [[MIXED, MIXED]] * W and combined == [[True, True]] * W
    assert [sorted(sources(t, 2)) for t in tags[0].tolist()] == [[(r, 0) for r in range(W)], [(r, 1) for r in range(W)]]


def test_a_copy_takes_its_source_colour_even_where_values_are_equal(cases):
    before, after, tags = _split(cases, "broadcast")
    assert after[2].tolist() == before[2].tolist()              # rank 2 held rank 0's values already...
    ids, combined = colours_from_origins(rank_colours(before), tags, width=2)
    assert ids == [[0, 0]] * W and combined == [[False, False]] * W   # ...but after the call they are rank 0's copy
    before, after, tags = _split(cases, "all_gather")
    ids, _ = colours_from_origins(rank_colours(before), tags, width=1)
    assert ids == [list(range(W))] * W                          # four equal 5s, four different sources


def test_chunks_keep_their_colour_through_a_reduce_scatter(cases):
    before, after, tags = _split(cases, "reduce_scatter")
    ids, combined = colours_from_origins(rank_colours(before, by="chunk"), tags, width=2 * W)
    assert ids == [[r, r] for r in range(W)] and combined == [[True, True]] * W


def test_elements_nobody_wrote_are_told_apart_from_reductions(cases):
    before, after, tags = _split(cases, "send_recv")
    ids, combined = colours_from_origins(rank_colours(before), tags, width=2)
    assert ids == [[0, 0], [0, 0], [2, 2], [3, 3]] and not any(any(c) for c in combined)
    zeros = [torch.zeros(2, dtype=torch.int64)] * W
    assert colours_from_origins(rank_colours(before), zeros, width=2)[0] == [[UNWRITTEN, UNWRITTEN]] * W


def test_max_records_the_winning_ranks(cases):
    before, after, tags = _split(cases, "max")
    assert all(a.tolist() == [9, 4] for a in after)
    assert sources(tags[0][0].item(), 2) == [(1, 0), (3, 0)]   # a tie: both winners
    assert sources(tags[0][1].item(), 2) == [(0, 1)]


def test_the_figure_colours_follow_the_recorded_flow_and_keep_numbers_readable(cases):
    before, after, tags = _split(cases, "all_reduce")
    fig = before_after("all_reduce", before, after, origins=tags)
    ax_before, ax_after = fig.axes
    fill, hatch = _cell(ax_after, 0, 0, W)                     # rank 0's sum 10, equal to rank 0's own 10
    assert mcolors.to_hex(fill.get_facecolor()) == REDUCED and hatch is not None
    own, own_hatch = _cell(ax_before, 0, 0, W)
    assert mcolors.to_hex(own.get_facecolor()) == mcolors.to_hex(PALETTE[0]) and own_hatch is None
    label = next(t for t in ax_after.texts if t.get_text() == "10")
    assert label.get_bbox_patch() is not None and label.get_zorder() > hatch.get_zorder()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(s.startswith("grey") for s in legend) and not any(s.startswith("white") for s in legend)
    plt.close(fig)
    before, after, tags = _split(cases, "broadcast")
    fig = before_after("broadcast", before, after, origins=tags)
    fill, hatch = _cell(fig.axes[1], 0, 2, W)
    assert mcolors.to_hex(fill.get_facecolor()) == mcolors.to_hex(PALETTE[0]) and hatch is None
    plt.close(fig)


def test_before_after_draws_every_rank_and_value():
    before = [torch.tensor([r, r + 0.5]) for r in range(4)]
    after = [None, torch.tensor([1.5]), None, None]
    fig = before_after("demo", before, after, after_ids=[None, [1], None, None])
    ax_before, ax_after = fig.axes
    assert [t.get_text() for t in ax_before.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert _texts(ax_before).count("0.5") == 1 and "3.5" in _texts(ax_before)
    assert _texts(ax_after).count("(nothing)") == 3 and "1.5" in _texts(ax_after)
    plt.close(fig)


def test_panels_need_recorded_provenance_or_explicit_colours():
    rows = [torch.arange(4) + 10 * r for r in range(2)]
    with pytest.raises(ValueError, match="never from equal values"):
        rank_panels([("a", rows), ("b", rows)], "no provenance")
    fig = rank_panels([("a", rows), ("c", [torch.tensor([1]), torch.tensor([2])])], "two",
                      first_ids=rank_colours(rows, by="chunk"), ids=[[[0], [1]]], rank_labels=["n0", "n1"])
    assert len(fig.axes) == 2 and fig._suptitle.get_text() == "two" and not fig.legends
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["n0", "n1"]
    assert rank_colours([torch.arange(7)], by="chunk", chunks=3) == [[0, 0, 0, 1, 1, 1, 2]]  # like torch.chunk
    plt.close(fig)
