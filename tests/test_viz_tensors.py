"""Per-rank tensor grids: one row per rank, values written in, a chunk's colour follows it between panels."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from course_lib.viz.tensors import MIXED, before_after, follow_colours, rank_colours, rank_panels  # noqa: E402


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_colours_follow_chunks_and_reductions_are_mixed():
    before = [torch.tensor([10 * r, 10 * r + 1]) for r in range(3)]
    ids = rank_colours(before)
    assert ids == [[0, 0], [1, 1], [2, 2]]
    gathered = [torch.cat(before)] * 3
    assert follow_colours(before, ids, gathered) == [[0, 0, 1, 1, 2, 2]] * 3
    summed = [sum(before)] * 3  # 30, 33: found in no single chunk
    assert follow_colours(before, ids, summed) == [[MIXED, MIXED]] * 3
    assert rank_colours([torch.arange(7)], by="chunk", chunks=3) == [[0, 0, 0, 1, 1, 1, 2]]  # like torch.chunk


def test_before_after_draws_every_rank_and_value():
    before = [torch.tensor([r, r + 0.5]) for r in range(4)]
    after = [None, torch.tensor([1.5]), None, None]
    fig = before_after("demo", before, after)
    ax_before, ax_after = fig.axes
    assert [t.get_text() for t in ax_before.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert _texts(ax_before).count("0.5") == 1 and "3.5" in _texts(ax_before)
    assert _texts(ax_after).count("(nothing)") == 3 and "1.5" in _texts(ax_after)
    plt.close(fig)


def test_panels_compose_and_accept_explicit_colours():
    rows = [torch.arange(4) + 10 * r for r in range(2)]
    fig = rank_panels([("a", rows), ("b", rows), ("c", [torch.tensor([1]), torch.tensor([2])])], "three",
                      first_ids=rank_colours(rows, by="chunk"), ids=[None, [[0], [1]]], rank_labels=["n0", "n1"])
    assert len(fig.axes) == 3 and fig._suptitle.get_text() == "three"
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["n0", "n1"]
    plt.close(fig)
