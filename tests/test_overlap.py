"""Overlap over an emulated NIC (notebook 09): the same weights as one process on the combined batch whether buckets
travel during or after backward, every bucket launched from inside backward, and every transfer held at least the
link model's ring time. One launch per mode, 2 ranks, a small model."""

import torch
from torch import nn

from course_lib import run
from course_lib.costs import alpha_beta
from course_lib.measure.emulated_link import Link
from course_lib.training.data import combined_batch, load_digits
from course_lib.training.model import flat_params
from course_lib.training.overlap import balanced_link, deep_mlp, overlap_compare

LINK = Link("test link", alpha=1e-3, bandwidth=200e6)
KW = dict(steps=2, depth=4, width=64, batch_size=32, lr=0.05)


def _both_placements_and_a_balanced_link():
    return overlap_compare(link=LINK, **KW), balanced_link(depth=4, width=64, batch_size=32)


def _single_process(steps, depth, width, batch_size, lr, n=2, **_):
    x, y = load_digits()
    model = deep_mlp(depth, width)
    for step in range(steps):
        xb, yb = combined_batch(x, y, n, batch_size, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return flat_params(model)


def test_overlap_and_after_backward_train_the_same_weights_within_the_link_model():
    ref = _single_process(**KW)
    res = run(_both_placements_and_a_balanced_link, world_size=2, output="none", timeout=120).values
    out = {ov: [r[0]["during" if ov else "after"] for r in res] for ov in (False, True)}
    links = [r[1] for r in res]
    assert links[0] == links[1] and links[0].bandwidth > 0      # every rank agrees on the balanced link
    for ov, ranks in out.items():
        for v in ranks:
            # float32: the two ranks' mean gradients summed and halved vs one mean over the combined batch
            assert torch.allclose(v["params"], ref, atol=1e-5), ov
            assert len(v["bucket_bytes"]) == KW["depth"]          # one bucket per layer
            comm = [e for e in v["timeline"] if e[0] == "comm"]
            assert len(comm) == KW["depth"] * KW["steps"]
            by_name = dict(zip([f"bucket {i}" for i in range(KW["depth"])], v["bucket_bytes"]))
            for _, name, s, e in comm:                            # sleeps make the link model a floor
                assert e - s >= alpha_beta.ring_allreduce(2, by_name[name], LINK.alpha, LINK.beta) - 1e-4
    for v in out[True]:
        backward = [(s, e) for lane, name, s, e in v["timeline"] if name == "backward"]
        for step, _, t in v["launched"]:                          # every bucket leaves from inside backward
            assert backward[step][0] <= t <= backward[step][1]
    for v in out[False]:
        backward = [(s, e) for lane, name, s, e in v["timeline"] if name == "backward"]
        for _, _, s, _ in (e for e in v["timeline"] if e[0] == "comm"):   # after backward: none starts inside it
            assert not any(bs < s < be for bs, be in backward)
