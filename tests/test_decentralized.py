"""Notebook 11's decentralized training: topologies and spectral gaps (no ranks), every trainer against its
single-process reference and its bytes against the formulas (one launch at 3 ranks, one at 4), DDP's PowerSGD hook's
messages, the straggler, the bench's PS row, and the hand-written optimizers against torch.optim."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib import run
from course_lib.bench import decentralized as bench
from course_lib.costs.decentralized import SCHEMES, Scheme, sent_per_step, step_seconds
from course_lib.training import gossip, local_sgd, make_mlp, train_single
from course_lib.training.compression import (
    compressed_train,
    powersgd_atol,
    powersgd_sizes,
    ring_sent_bytes,
    simulate_powersgd,
    topk_sent_bytes,
)
from course_lib.training.model import flat_params
from course_lib.training.tolerance import max_diff

HIDDEN = 32
SHAPES = [tuple(q.shape) for q in make_mlp(HIDDEN).parameters()]
NUMEL = sum(math.prod(s) for s in SHAPES)


def test_mixing_matrices_are_doubly_stochastic_and_neighbours_agree():
    for topo in gossip.TOPOLOGIES:
        for p in (2, 3, 4, 5, 6, 8, 9, 12, 16):
            for step in range(gossip.tau(p)):
                w = gossip.mixing_matrix(topo, p, step)
                ones = torch.ones(p, dtype=torch.float64)
                assert torch.allclose(w.sum(0), ones) and torch.allclose(w.sum(1), ones), (topo, p)
                for r in range(p):
                    assert all(r in gossip.in_neighbours(topo, p, q, step)
                               for q in gossip.out_neighbours(topo, p, r, step)), (topo, p, r)


def test_spectral_gaps_match_their_closed_forms():
    for p in range(4, 66, 2):      # static exponential graph, every even p: gap 2 / (1 + tau), tau = ceil(log2 p)
        assert math.isclose(gossip.spectral_gap(gossip.mixing_matrix("exponential", p)), 2 / (1 + gossip.tau(p)),
                            rel_tol=1e-9), p
    for p in range(3, 13):         # ring with weights 1/3: eigenvalues (1 + 2 cos(2 pi k / p)) / 3
        rho = max(abs(1 + 2 * math.cos(2 * math.pi * k / p)) / 3 for k in range(1, p))
        assert math.isclose(gossip.rho(gossip.mixing_matrix("ring", p)), rho, rel_tol=1e-9, abs_tol=1e-12)
    assert gossip.spectral_gap(gossip.mixing_matrix("complete", 7)) == pytest.approx(1.0)
    for p, exact in ((4, True), (8, True), (16, True), (6, False)):     # one-peer exponential: tau rounds
        prod = torch.eye(p, dtype=torch.float64)
        for t in range(gossip.tau(p)):
            prod = gossip.mixing_matrix("one-peer exponential", p, t) @ prod
        assert torch.allclose(prod, torch.full((p, p), 1 / p, dtype=torch.float64)) == exact, p


def test_every_mixing_matrix_is_normal_so_rho_is_its_largest_other_eigenvalue():
    for topo in gossip.TOPOLOGIES:
        for p in (3, 4, 6, 8, 12, 16):
            for step in range(gossip.tau(p)):
                w = gossip.mixing_matrix(topo, p, step)
                assert torch.allclose(w @ w.T, w.T @ w, atol=1e-12), (topo, p, step)
                lam = torch.linalg.eigvals(w - 1 / p).abs().max().item()
                assert math.isclose(gossip.rho(w), lam, rel_tol=1e-9, abs_tol=1e-12), (topo, p, step)
    # one round of the one-peer graph on 8 ranks: hops 2 and 4 leave it disconnected (rho = 1), yet the 3 rounds
    # together average exactly: a time-varying graph is judged by its product
    rhos = [gossip.rho(gossip.mixing_matrix("one-peer exponential", 8, t)) for t in range(3)]
    assert rhos[0] == pytest.approx(math.cos(math.pi / 8)) and rhos[1] == pytest.approx(1) == rhos[2]


def test_steady_spread_is_the_sum_over_eigenvalues():
    assert gossip.steady_spread(gossip.mixing_matrix("complete", 8)) == pytest.approx(0, abs=1e-12)
    for p in (5, 8, 12):           # ring: eigenvalues (1 + 2 cos(2 pi k / p)) / 3
        lam2 = [((1 + 2 * math.cos(2 * math.pi * k / p)) / 3) ** 2 for k in range(1, p)]
        assert gossip.steady_spread(gossip.mixing_matrix("ring", p)) == pytest.approx(
            sum(x / (1 - x) for x in lam2) / p, rel=1e-9)
    assert gossip.steady_spread(gossip.mixing_matrix("one-peer exponential", 8, 1)) == math.inf


def test_rounds_to_consensus():
    ring = gossip.mixing_matrix("ring", 8)
    rho = gossip.rho(ring)
    t = gossip.rounds_to_consensus(ring, 1e-3)
    assert rho ** t <= 1e-3 < rho ** (t - 1)
    assert gossip.rounds_to_consensus(gossip.mixing_matrix("complete", 8), 1e-3) == 1
    periodic = torch.zeros(6, 6, dtype=torch.float64)
    for i in range(6):
        periodic[i, (i + 1) % 6] = periodic[i, (i - 1) % 6] = 0.5
    assert gossip.rounds_to_consensus(periodic, 1e-3) == math.inf


def test_hand_written_optimizers_equal_torch_optim():
    torch.manual_seed(0)
    w0 = torch.randn(50)
    grads = [torch.randn(50) for _ in range(4)]
    mine, buf = w0.clone(), torch.zeros(50)
    ref = w0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=local_sgd.OUTER_LR, momentum=local_sgd.OUTER_MOMENTUM, nesterov=True)
    for g in grads:
        local_sgd.nesterov_(mine, g, buf)
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(mine, ref.detach(), atol=1e-6)
    mine, m, v = w0.clone(), torch.zeros(50), torch.zeros(50)
    ref = w0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=local_sgd.INNER_LR, weight_decay=local_sgd.WEIGHT_DECAY)
    for t, g in enumerate(grads, 1):
        local_sgd.adamw_(mine, g, m, v, t)
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(mine, ref.detach(), atol=1e-6)


def _everything(with_ddp: bool):
    """On every rank: each trainer briefly (hidden 32), the straggler, and DDP's PowerSGD hook's messages."""
    from torch import nn

    from course_lib.measure.collective_calls import counted
    from course_lib.training import load_digits, worker_batch

    last = dist.get_world_size() - 1
    out = {"dsgd": {t: gossip.dpsgd_train(t, steps=4, hidden=HIDDEN, measure_consensus=False)
                    for t in gossip.TOPOLOGIES},
           "H1": local_sgd.local_sgd_train(H=1, steps=3, hidden=HIDDEN),
           "H2": local_sgd.local_sgd_train(H=2, steps=4, hidden=HIDDEN),
           "diloco": local_sgd.local_sgd_train(H=2, steps=4, hidden=HIDDEN, outer="nesterov", dtype=torch.float64),
           "powersgd": compressed_train("powersgd", steps=3, hidden=HIDDEN),
           "powersgd64": compressed_train("powersgd", steps=3, hidden=HIDDEN, dtype=torch.float64),
           "topk": compressed_train("topk", steps=3, hidden=HIDDEN, k_fraction=0.05),
           "topk_all": compressed_train("topk", steps=3, hidden=HIDDEN, k_fraction=1.0),
           "straggler": local_sgd.local_sgd_train(H=1, steps=4, hidden=HIDDEN, straggler=(last, 3.0, 0.02))}
    if with_ddp:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        model = nn.parallel.DistributedDataParallel(make_mlp(HIDDEN), bucket_cap_mb=100)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        x, y = load_digits()
        sizes = []
        for step in range(4):
            xb, yb = worker_batch(x, y, dist.get_rank(), dist.get_world_size(), 16, step)
            with counted() as calls:
                nn.functional.cross_entropy(model(xb), yb).backward()
            sizes.append([c.numel for c in calls])
        out["ddp"] = sizes
    return out


@pytest.mark.parametrize("p", [3, 4])
def test_every_trainer_equals_its_single_process_reference_and_sends_its_formula(p):
    vals = run(_everything, p, args=(p == 4,), output="none", timeout=120).values
    # every tolerance is what rounding alone allows (training/tolerance.py): SGD steps, each followed by a mean of at
    # most p models (gossip round, local SGD's average, top-k's all-gathered sum / p) in float32; DiLoCo (AdamW) and
    # PowerSGD (a QR of a rounded P) compared in float64, where their first-order bounds still say something
    single, _ = train_single(p, 3, 32, hidden=HIDDEN)
    m = 4 * NUMEL
    for topo in gossip.TOPOLOGIES:
        sim = gossip.simulate(topo, p, 4, hidden=HIDDEN)
        tol = gossip.averaged_sgd_atol(4, 0.1, 32, HIDDEN, p)
        for rank, v in enumerate(vals):
            r = v["dsgd"][topo]
            assert max_diff(r["params"], sim[rank]) <= tol, (topo, rank)
            for step, (sent, recv) in enumerate(r["traffic"]):      # d messages of M bytes, each way
                assert sent == len(gossip.out_neighbours(topo, p, rank, step)) * m, (topo, rank, step)
                assert recv == len(gossip.in_neighbours(topo, p, rank, step)) * m, (topo, rank, step)
            want = sent_per_step(Scheme("gossip", topology=topo), p, SHAPES, rank)
            assert sum(s for s, _ in r["traffic"]) / 4 == want or topo == "one-peer exponential" and p == 3
    sims = {"H2": (local_sgd.simulate(p, 2, 4, hidden=HIDDEN), gossip.averaged_sgd_atol(4, 0.1, 32, HIDDEN, p)),
            "diloco": (local_sgd.simulate(p, 2, 4, hidden=HIDDEN, outer="nesterov", dtype=torch.float64),
                       local_sgd.diloco_atol(p, 2, 4, hidden=HIDDEN)),
            "powersgd64": (simulate_powersgd(p, 3, hidden=HIDDEN, dtype=torch.float64),
                           powersgd_atol(p, 3, hidden=HIDDEN)),
            "H1": (single, gossip.averaged_sgd_atol(3, 0.1, p * 32, HIDDEN, p)),
            "topk_all": (single, gossip.averaged_sgd_atol(3, 0.1, p * 32, HIDDEN, p))}
    for rank, v in enumerate(vals):
        for name, (ref, tol) in sims.items():
            assert max_diff(v[name]["params"], ref) <= tol, (name, rank, max_diff(v[name]["params"], ref), tol)
        assert [s for s, _ in v["H1"]["traffic"]] == [ring_sent_bytes(NUMEL, p, rank)] * 3
        assert [s for s, _ in v["H2"]["traffic"]] == [0, ring_sent_bytes(NUMEL, p, rank)] * 2
        a, b = powersgd_sizes(SHAPES, 2)
        assert [s for s, _ in v["powersgd"]["traffic"]] == [ring_sent_bytes(a, p, rank)
                                                            + ring_sent_bytes(b, p, rank)] * 3
        assert all(s == topk_sent_bytes(int(0.05 * NUMEL), p) for s, _ in v["topk"]["traffic"])
        # straggler: compute padded to 20 ms, the last rank's to 60 ms (sleeps can only run long)
        floor = 0.06 if rank == p - 1 else 0.02
        assert all(c >= floor for c in v["straggler"]["compute_s"]), (rank, v["straggler"]["compute_s"])
        # everyone waits for the straggler: a step lasts its 60 ms, less at most the few ms by which the ring's last
        # messages reach the ranks at different times (the first step also waits for the ranks to start: left out)
        assert sum(v["straggler"]["step_s"][1:]) / 3 >= 0.05, (rank, v["straggler"]["step_s"])
    if p == 4:       # DDP's hook: plain all-reduce before step 2, then uncompressed + Ps, then Qs (= our two)
        a, b = powersgd_sizes(SHAPES, 2)
        for v in vals:
            assert v["ddp"][0] == v["ddp"][1] == [NUMEL]
            assert all(len(s) == 3 and s[0] + s[1] == a and s[2] == b for s in v["ddp"][2:])


def test_bench_ps_row_bytes_equal_the_formula():
    (row,) = bench.compare(["sync PS"], loss_steps=2, timed=())
    m = 4 * sum(q.numel() for q in make_mlp().parameters())
    assert row["sent_per_worker_B"] == row["formula_sent_per_worker_B"] == m
    assert row["busiest_rank_sent_B"] == 4 * m        # the server sends every worker the model


def test_a_straggler_sets_one_pace_on_the_one_peer_graph_too():
    # the one-peer graph's schedule repeats every tau = 2 steps at 4 workers; a fast rank that hears from the
    # straggler every other round alternates 50 and 10 ms steps, so a window of whole periods reads the straggler's
    # 30 ms plus one message (0.27 ms on 10 GbE), as all-reduce does, where 7 steps read about 33 ms
    (row,) = bench.compare(["gossip, one-peer exp."], loss_steps=0, configs=("straggler",))
    assert row["time_steps"] == 10
    assert 30.0 < row["step_ms_straggler"] < 30.5, row


def test_projection_is_flat_for_gossip_and_local_sgd_and_grows_for_ps():
    slow = bench.link(bench.SLOW)
    shapes = [tuple(q.shape) for q in make_mlp().parameters()]
    at = {n: [step_seconds(SCHEMES[n], w, shapes, slow) for w in (4, 64, 1024)] for n in SCHEMES}
    assert at["gossip, ring"][0] == at["gossip, ring"][2] and at["gossip, one-peer exp."][1] == at[
        "gossip, one-peer exp."][2]
    assert at["sync PS"][2] > 200 * at["sync PS"][0]
    assert at["local SGD, H=16"][2] < at["all-reduce DP"][2] / 15
    assert flat_params(make_mlp()).numel() * 4 == 340008


def test_the_tree_all_reduce_pays_log_p_latency_and_twice_the_model():
    # NCCL's double binary tree (NVIDIA/nccl issue 457: each GPU sends 2*S; lg p levels up and down)
    from course_lib.costs import alpha_beta
    from course_lib.costs.decentralized import MODEL_ONLY
    from course_lib.measure import emulated_link

    tree, ring = MODEL_ONLY["all-reduce DP, tree"], SCHEMES["all-reduce DP"]
    assert alpha_beta.double_tree_allreduce(1024, 1e6, 1e-4, 1e-9) == 2 * 10 * 1e-4 + 2 * 1e6 * 1e-9
    shapes = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
    slow = emulated_link.link("100 MbE")
    # at 4 workers the ring's 2(p-1)/p M beats the tree's 2M; at 1024 the ring's 2(p-1) alphas lose to 2 lg p
    assert step_seconds(ring, 4, shapes, slow) < step_seconds(tree, 4, shapes, slow)
    assert step_seconds(tree, 1024, shapes, slow) < step_seconds(ring, 1024, shapes, slow)
    assert sent_per_step(tree, 8, shapes) == 2 * 4 * sum(math.prod(s) for s in shapes)
    # PowerSGD's two small all-reduces on the tree: at 1024 workers under the ring's PowerSGD and the tree's DP
    psgd_tree, psgd_ring = MODEL_ONLY["PowerSGD, r=2, tree"], SCHEMES["PowerSGD, r=2"]
    assert step_seconds(psgd_tree, 1024, shapes, slow) < step_seconds(tree, 1024, shapes, slow)
    assert step_seconds(psgd_tree, 1024, shapes, slow) < step_seconds(psgd_ring, 1024, shapes, slow) / 10


def _adamw_local_against_diloco_with_a_plain_average():
    def plain(flat, anchor, buf):                   # outer lr 1, momentum 0: the anchor becomes the models' mean
        d = anchor - flat
        dist.all_reduce(d)
        d /= dist.get_world_size()
        anchor.sub_(d)
        flat.copy_(anchor)
    kw = dict(H=2, steps=4, hidden=HIDDEN, dtype=torch.float64)
    ctrl = local_sgd.local_sgd_train(inner="adamw", **kw)
    diloco_plain = local_sgd.local_sgd_train(outer="nesterov", outer_step=plain, **kw)
    sgd = local_sgd.local_sgd_train(**kw)
    return ctrl["params"], diloco_plain["params"], sgd["params"]


def test_the_adamw_control_is_diloco_without_its_outer_optimizer():
    # notebook 11b's control row: local SGD's plain average with DiLoCo's AdamW inner steps
    for ctrl, diloco_plain, sgd in run(_adamw_local_against_diloco_with_a_plain_average, 2, output="none",
                                       timeout=60).values:
        # float64, the same operations in the same order on both sides except the mean's: (a + b) / 2 against
        # a - (a - b) / 2, a few units of float64's 1.1e-16 on weights below 1
        assert max_diff(ctrl, diloco_plain) < 1e-12
        assert max_diff(ctrl, sgd) > 1e-3                 # the inner optimizer is AdamW, not SGD
    with pytest.raises(ValueError, match="inner None, 'sgd' or 'adamw'"):
        local_sgd.local_sgd_train(inner="adam")
