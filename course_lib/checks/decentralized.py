"""Checkers for the exercises of notebooks 11 and 11b (gossip; local SGD and DiLoCo).

11.1 compares the learner's rounds to consensus with the library's on mixing matrices that trap the usual
mistakes; 11.2 runs the learner's one-peer gossip round on real ranks with every collective switched off and
checks each round's result (against the mixing matrix, Ying et al. NeurIPS 2021) and its messages (one send, to the
right peer); 11b.1 trains DiLoCo with the learner's outer step against a single-process DiLoCo and counts its
all-reduces, naming the variant a wrong answer reproduces; 11b.2 compares the learner's crossover (the workers from
which PowerSGD's two ring all-reduces lose to one of the whole model) with the alpha-beta model's on five links.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from ..runtime.devices import device
from ..training import gossip, local_sgd, tolerance
from .core import ExerciseFailed, call_learner, launch_checked, passed, watched_call, with_hint
from .watch import summary


def _bipartite_ring(p: int) -> torch.Tensor:
    """Each rank keeps nothing of itself and half of each neighbour: an eigenvalue -1 (even p), never agrees."""
    w = torch.zeros(p, p, dtype=torch.float64)
    for i in range(p):
        w[i, (i + 1) % p] = w[i, (i - 1) % p] = 0.5
    return w


def _matrices():
    """(what, W): symmetric and non-symmetric (exponential) matrices, a periodic one, the complete graph."""
    out = [(f"{t}, p={p}", gossip.mixing_matrix(t, p)) for t, p in
           [("ring", 4), ("ring", 8), ("ring", 16), ("ring", 64), ("torus", 16), ("torus", 12),
            ("exponential", 6), ("exponential", 8), ("exponential", 12), ("one-peer exponential", 8),
            ("complete", 8)]]
    return out + [("ring of 6 keeping no share of itself", _bipartite_ring(6))]


def check_rounds_to_consensus(rounds_to_consensus, exercise: str = "Exercise 11.1 (rounds to consensus)") -> None:
    """`rounds_to_consensus(W, eps)` -> the fewest gossip rounds t with rho^t <= eps (rho = the largest |eigenvalue|
    of W other than the average's 1, = ||W - 11^T/p||_2 here), math.inf when rho >= 1. Compared with the library's
    on ring, torus, exponential (not symmetric) and periodic mixing matrices."""
    hint = ("The distance to consensus shrinks by the second-largest eigenvalue magnitude of W (the average's "
            "eigenvalue 1 set aside) each round. Is every W here symmetric, and does your eigenvalue routine assume "
            "it? How many rounds until that factor to the power t is at most eps?")
    library = ("course_lib.training.gossip.rho", "course_lib.training.gossip.spectral_gap",
               "course_lib.training.gossip.rounds_to_consensus")
    cases = 0
    for what, w in _matrices():
        for eps in (1e-2, 3e-5):
            want = gossip.rounds_to_consensus(w, eps)
            r = gossip.rho(w)
            if 0 < r < 1 and abs(math.log(eps) / math.log(r) - round(math.log(eps) / math.log(r))) < 1e-6:
                continue            # rho^t within rounding of eps: either answer would be right
            got = call_learner(exercise, rounds_to_consensus, w.clone(), eps, library=library,
                               why="computing rho yourself", hint=hint)
            if got != want:
                raise ExerciseFailed(with_hint(f"{exercise}: for the {what} and eps={eps:g} you said {got!r}: "
                                               f"{_which_way(got, want, r, eps)}", hint))
            cases += 1
    passed(exercise, f"{cases} cases (rings, tori, exponential graphs that are not symmetric, the complete graph and "
                     f"a periodic ring) agree with rho computed from the mixing matrix.")


def _which_way(got, want, r: float, eps: float) -> str:
    """Why an answer is wrong, with what was measured, without the expected count itself."""
    if want == math.inf:
        return "this W keeps an eigenvalue of size 1 besides the average's, so its replicas never agree."
    if not isinstance(got, int | float) or got == math.inf:
        return "this W's replicas do agree: rho < 1."
    if got < want:
        return f"too few: after {got} rounds the bound rho^t is still {r ** got:.3g} > eps."
    return f"too many: after {got} rounds the bound rho^t is {r ** got:.3g}, and fewer rounds already reach eps."


def _one_peer_case(learner, rounds, exercise):
    """Runs on every rank: its own start vector, `rounds` learner rounds with collectives off, every round kept."""
    rank = dist.get_rank()
    x = torch.randn(37, generator=torch.Generator().manual_seed(rank)).to(device())
    out = [x.cpu().clone()]
    records = []
    for t in range(rounds):
        x, record = watched_call(exercise, learner, (x, t), forbid="all", why="gossip with your neighbours only",
                                 library=("course_lib.training.gossip.gossip_round",
                                          "course_lib.training.gossip.out_neighbours",
                                          "course_lib.training.gossip.in_neighbours",
                                          "course_lib.training.gossip._offsets",
                                          "course_lib.training.gossip.mixing_matrix"))
        out.append(x.detach().cpu().clone())
        records.append(record)
    return out, records


def check_one_peer_gossip(one_peer_round, exercise: str = "Exercise 11.2 (one-peer exponential gossip)") -> None:
    """`one_peer_round(x, t)` -> this rank's new vector after round t of the one-peer exponential graph: send x to
    rank + 2^(t mod tau), receive from rank - 2^(t mod tau) (mod p, tau = ceil(log2 p)), return the mean of the
    two. Run on 3 and 8 real ranks with every collective switched off: each round must equal W(t) X and send exactly
    one message, the size of x, to the right peer; at 8 ranks tau = 3 rounds give the exact average."""
    hint = ("In exponential-graph gossip each round talks to one peer at a distance that is a power of two. Which "
            "distance in round t, after how many rounds does it repeat, and can two ranks that both send first wait on "
            "each other?")
    for p in (3, 8):
        rounds = 2 * gossip.tau(p)
        vals = launch_checked(exercise, _one_peer_case, p, args=(one_peer_round, rounds, exercise), hint=hint,
                              what=f"{p} ranks")
        xs = torch.stack([v[0][0] for v in vals]).double()
        size = xs.abs().max().item()
        for t in range(rounds):
            xs = gossip.mixing_matrix("one-peer exponential", p, t) @ xs
            hop = 2 ** (t % gossip.tau(p))
            for rank, (got, records) in enumerate(vals):
                s = summary(records[t])
                right = ([(rank + hop) % p], [(rank - hop) % p], 1)
                if (s["messages_sent"], s["bytes_sent"], len(s["recv_from"])) != (1, 37 * 4, 1):
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {p} ranks, round {t}: rank {rank} sent {s['messages_sent']} message(s) "
                        f"({s['bytes_sent']} bytes) to {s['sent_to']} and received from {s['recv_from']}; the "
                        f"one-peer graph sends one message of x ({37 * 4} bytes) to one rank and receives one.", hint))
                if (s["sent_to"], s["recv_from"], s["messages_sent"]) != right:
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {p} ranks, round {t}: rank {rank} sent to {s['sent_to']} and received from "
                        f"{s['recv_from']}: one message each way, but not to and from round {t}'s peers. Which "
                        f"distance belongs to round {t}, and which way does the message go?", hint))
                # each float32 round is one mean of two numbers (mean_atol); a mean never amplifies what earlier
                # rounds already rounded, so after t + 1 rounds the float64 product of the W(t) is that many away
                if tolerance.max_diff(got[t + 1], xs[rank]) > (t + 1) * gossip.mean_atol(2, size):
                    raise ExerciseFailed(with_hint(
                        f"{exercise}: {p} ranks, round {t}: rank {rank} holds {got[t + 1][:3].tolist()}..., not the "
                        f"mean of its vector and its peer's.", hint))
            if p & (p - 1) == 0 and t + 1 == gossip.tau(p):
                mean = torch.stack([v[0][0] for v in vals]).double().mean(0)
                if any(tolerance.max_diff(v[0][t + 1], mean) > (t + 1) * gossip.mean_atol(2, size) for v in vals):
                    raise ExerciseFailed(with_hint(f"{exercise}: {p} ranks: after tau = {t + 1} rounds the ranks "
                                                   f"should all hold the exact average, they do not.", hint))
    passed(exercise, "every round on 3 and 8 ranks equals the mixing matrix's, with one message of x per rank to "
                     "the right peer and every collective switched off; after log2(8) = 3 rounds all 8 ranks hold "
                     "the exact average.")


H, STEPS, HIDDEN = 4, 12, 32


def _diloco_case(outer_step, exercise):
    """Runs on every rank: DiLoCo with the learner's outer step, the collective calls of each outer step recorded
    (only there: recording every op of the inner steps would cost more than the training)."""
    records = []

    def watched(flat, anchor, momentum):
        _, record = watched_call(exercise, outer_step, (flat, anchor, momentum), why="the outer step",
                                 library=("course_lib.training.local_sgd.diloco_outer_step",
                                          "course_lib.training.local_sgd.nesterov_"))
        records.append(record)

    # float64: float32 AdamW leaves no useful rounding bound (local_sgd.diloco_atol), a wrong outer step would hide
    out = local_sgd.local_sgd_train(H=H, steps=STEPS, hidden=HIDDEN, outer="nesterov", outer_step=watched,
                                    dtype=torch.float64)
    return out["params"], [c for r in records for c in summary(r)["collective_calls"]]


def _variants(p: int):
    """Outer steps of the usual mistakes, for local_sgd.simulate: what each wrong answer would end with."""
    lr, mu = local_sgd.OUTER_LR, local_sgd.OUTER_MOMENTUM

    def mean(flats):
        return torch.stack(flats).sum(0) / p

    def summed(flats, anchor, buf):        # the sum of the p pseudo-gradients anchor - flat_i
        local_sgd.nesterov_(anchor, p * anchor - torch.stack(flats).sum(0), buf)
        return anchor.clone()

    def flipped(flats, anchor, buf):
        local_sgd.nesterov_(anchor, mean(flats) - anchor, buf)
        return anchor.clone()

    def heavy_ball(flats, anchor, buf):
        buf.mul_(mu).add_(anchor - mean(flats))
        anchor.sub_(lr * buf)
        return anchor.clone()

    def fresh_buffer(flats, anchor, buf):  # e.g. a new torch.optim.SGD every call, its own buffer empty
        local_sgd.nesterov_(anchor, anchor - mean(flats), torch.zeros_like(buf))
        return anchor.clone()

    return {"the pseudo-gradients summed, not averaged (divide by the world size)": summed,
            "a momentum buffer that starts empty every round: the caller's `momentum` must carry it across rounds":
                fresh_buffer,
            "the pseudo-gradient's sign flipped (it is anchor - flat: the way the inner steps went, reversed)": flipped,
            "plain (heavy-ball) momentum, not Nesterov's: compare your update with the one torch.optim.SGD's "
            "documentation gives for nesterov=True": heavy_ball,
            "the plain average of the models, i.e. local SGD (no outer optimizer)":
                lambda flats, anchor, buf: mean(flats)}


def check_diloco_outer_step(diloco_outer_step,
                            exercise: str = "Exercise 11b.1 (DiLoCo's outer step)") -> None:
    """`diloco_outer_step(flat, anchor, momentum)`: average anchor - flat over ranks with ONE dist.all_reduce, take
    a Nesterov step (lr local_sgd.OUTER_LR, momentum local_sgd.OUTER_MOMENTUM) on `anchor` in place, and set `flat`
    to it in place. DiLoCo (H=4, 12 steps, AdamW inner steps) on 2 and 3 real ranks must end with a single-process
    DiLoCo's weights, with one all-reduce of the whole model per outer step."""
    hint = ("DiLoCo's outer step treats how far the inner steps moved the weights as a gradient, averaged over the "
            "ranks, and hands it to an outer Nesterov optimizer. Which direction is that pseudo-gradient, and what "
            "does torch's Nesterov do with its momentum buffer? Do the caller's tensors change?")
    for p in (2, 3):
        vals = launch_checked(exercise, _diloco_case, p, args=(diloco_outer_step, exercise), hint=hint,
                              what=f"{p} ranks", timeout=60)
        ref = local_sgd.simulate(p, H, STEPS, hidden=HIDDEN, outer="nesterov", dtype=torch.float64)
        nbytes = ref.numel() * ref.element_size()
        tol = local_sgd.diloco_atol(p, H, STEPS, hidden=HIDDEN)     # rounding alone, float64: about 1e-6
        for rank, (params, calls) in enumerate(vals):
            reduces = [c for c in calls if c[0] == "all_reduce"]
            if len(reduces) != STEPS // H or any(c[1] != nbytes for c in reduces) or len(calls) != len(reduces):
                raise ExerciseFailed(with_hint(
                    f"{exercise}: {p} ranks: rank {rank} made these collective calls in {STEPS // H} outer steps: "
                    f"{[(c[0], c[1]) for c in calls]} (name, bytes); DiLoCo needs exactly one all_reduce of the "
                    f"whole pseudo-gradient ({nbytes} bytes) per outer step.", hint))
            if tolerance.max_diff(params, ref) <= tol:
                continue
            for mistake, step in _variants(p).items():
                wrong = local_sgd.simulate(p, H, STEPS, hidden=HIDDEN, outer="nesterov", outer_step=step,
                                           dtype=torch.float64)
                if tolerance.max_diff(params, wrong) <= tol:
                    raise ExerciseFailed(with_hint(f"{exercise}: {p} ranks: your weights are those of {mistake}.",
                                                   hint))
            bad = tolerance.max_diff(params, ref)
            raise ExerciseFailed(with_hint(f"{exercise}: {p} ranks: rank {rank}'s weights differ from single-process "
                                           f"DiLoCo by up to {bad:.3g} (rounding alone allows {tol:.1g}).", hint))
    passed(exercise, "DiLoCo with your outer step equals single-process DiLoCo on 2 and 3 ranks (float64, within what "
                     "rounding allows), with one all-reduce of the model's size per outer step.")


# (alpha s, bandwidth B/s one way, model numbers, compressed numbers): the course's links with notebook 11b's MLP and
# PowerSGD rank 2 (1566 + 1152 numbers), then other models; no case sits on an exact tie
_CROSSOVER_CASES = ((100e-6, 12.5e6, 85_002, 2_718), (50e-6, 125e6, 85_002, 2_718), (10e-6, 1.25e9, 85_002, 2_718),
                    (5e-6, 12.5e9, 25_600_000, 400_000), (1e-6, 50e9, 7_000_000, 90_000))


def _crossover(alpha: float, bandwidth: float, model: int, compressed: int) -> int:
    """Fewest p >= 2 with two ring all-reduces of P and Q (c numbers) slower than one of the model (m numbers):
    4(p-1)a + 2(p-1)/p 4c/B > 2(p-1)a + 2(p-1)/p 4m/B, i.e. p a > 4(m - c)/B (alpha_beta.ring_allreduce, float32)."""
    return max(2, math.floor(4 * (model - compressed) / (alpha * bandwidth)) + 1)


_CROSSOVER = ("course_lib.checks.decentralized._crossover", "course_lib.costs.alpha_beta.ring_allreduce",
              "course_lib.costs.alpha_beta.ring_reduce_scatter", "course_lib.costs.alpha_beta.ring_all_gather",
              "course_lib.costs.decentralized.step_seconds", "course_lib.costs.projection.ring_step")


def check_powersgd_crossover(powersgd_loses_from, exercise: str = "Exercise 11b.2 (when compression loses)") -> None:
    """`powersgd_loses_from(alpha, bandwidth, model_numbers, compressed_numbers)` -> the fewest workers p >= 2 at
    which PowerSGD's two ring all-reduces (P, then Q) take longer than one ring all-reduce of the whole float32
    model under the alpha-beta model; five links and models, the course's formulas switched off."""
    hint = ("Write both times with notebook 06's ring formula, 2(p-1) alpha + 2(p-1)/p S/B, S in bytes: PowerSGD "
            "pays it twice (P, then Q). Which terms grow with p, which shrink, and where do the two times cross?")
    for alpha, bw, m, c in _CROSSOVER_CASES:
        want = _crossover(alpha, bw, m, c)
        got = call_learner(exercise, powersgd_loses_from, alpha, bw, m, c, hint=hint, library=_CROSSOVER,
                           why="the alpha-beta cost of compression")
        got = got.item() if hasattr(got, "item") and getattr(got, "ndim", None) == 0 else got
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or not float(got).is_integer():
            raise ExerciseFailed(f"{exercise}: return a whole number of workers; you returned {got!r}.")
        got = int(got)
        if got == want:
            continue
        why = ""
        if got == max(2, math.floor((m - c) / (alpha * bw)) + 1):
            why = " Are your sizes in numbers where the formula wants bytes?"
        elif got == max(2, math.floor(4 * m / (alpha * bw)) + 1):
            why = " PowerSGD still sends its own bytes: the saving is the model's minus P's and Q's."
        where = "PowerSGD is slower already with fewer" if got > want else "there PowerSGD is not slower yet"
        raise ExerciseFailed(with_hint(f"{exercise}: with alpha = {alpha:g} s, {bw:g} B/s, {m} numbers compressed to "
                                       f"{c}, you said {got} workers: {where}.{why}", hint))
    passed(exercise, f"your crossover is right on {len(_CROSSOVER_CASES)} links and models; on 100 Mb/s this "
                     "notebook's PowerSGD loses to the plain ring from a few hundred workers on.")
