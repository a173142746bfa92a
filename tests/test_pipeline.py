"""Pipeline parallelism (notebook 14): schedules on the ideal clock, GPipe and 1F1B on real ranks equal to
single-process SGD with the activation bytes of the formula, torch.distributed.pipelining alike, the torchrun lab."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import run
from course_lib.measure.activations import mlp_activation_formula
from course_lib.training import pipeline as pl
from course_lib.training.data import load_digits
from course_lib.training.tolerance import max_diff, sgd_atol

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2


def test_both_schedules_give_the_bubble_formula_and_their_memory_on_the_ideal_clock():
    for p in range(1, 6):
        for m in range(1, 10):
            for name, order_fn in pl.SCHEDULES.items():
                orders = [order_fn(s, p, m) for s in range(p)]
                assert pl.simulated_bubble(orders) == [pl.bubble_formula(p, m)] * p, (name, p, m)
                assert [pl.peak_in_flight(o) for o in orders] == [pl.in_flight_formula(name, s, p, m)
                                                                  for s in range(p)], (name, p, m)


def test_a_run_replayed_with_its_own_costs_gives_its_wall_clock_bubble():
    """Timelines made by the clock itself (every action its own length, every hand-off 3 ms): hand_off_costs reads the
    3 ms back off them, and the replay with those costs gives the timelines' own bubble, which the costs raise above
    the formula; with no costs the replay is the formula."""
    for name, order_fn in pl.SCHEDULES.items():
        p, m = 4, 8
        orders = [order_fn(s, p, m) for s in range(p)]
        lengths = [[(0.010 if k == "F" else 0.020) * (1 + 0.1 * s) + 0.001 * i for k, i in o]
                   for s, o in enumerate(orders)]
        runs = pl.simulate(orders, message=0.003, between=0.003, durations=lengths)
        events = [[("compute", k, a, b) for k, _, a, b in r] for r in runs]
        costs = pl.hand_off_costs(events)
        assert costs == pytest.approx({"message": 0.003, "between": 0.003}, abs=1e-12), name
        replayed = pl.replayed_with_costs(events, costs)
        assert replayed == pytest.approx(pl.measured_bubble(events), abs=1e-12), name
        assert min(replayed) > float(pl.bubble_formula(p, m)), name
        assert pl.simulated_bubble(orders) == [pl.bubble_formula(p, m)] * p


def test_a_circular_wait_is_reported_as_a_deadlock():
    orders = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        pl.simulate(orders)


def test_stages_split_the_linears_evenly_and_refuse_too_many_stages():
    model = pl.make_deep_mlp()
    assert [sum(isinstance(m, nn.Linear) for m in model[a:b]) for a, b in pl.stage_bounds(model, 3)] == [2, 3, 3]
    with pytest.raises(ValueError, match="1 to 8 stages"):
        pl.stage_bounds(model, 9)


def _both_schedules(data):
    out = {}
    for name in pl.SCHEDULES:
        for m in (2, 8):                       # m < p and m > p
            out[name, m] = pl.pipeline_train(name, steps=STEPS, m=m, data=data)
    return out


@pytest.mark.parametrize("p", [3, 4])
def test_gpipe_and_1f1b_on_real_ranks_equal_single_process_sgd_with_the_formula_bytes(p):
    data = load_digits()
    reference, losses = pl.train_reference(STEPS)
    want = pl.stage_params(reference, p)
    vals = run(_both_schedules, world_size=p, args=(data,), output="none", timeout=120).values
    model = pl.make_deep_mlp()
    for (name, m), _ in vals[0].items():
        for s, v in enumerate(vals):
            r = v[name, m]
            # float32 sums of the batch in another order (per micro-batch, then accumulated): training.tolerance
            assert max_diff(r["params"], want[s]) <= sgd_atol(STEPS, 0.1, 32, 256), (name, m, s)
            layers = model[slice(*pl.stage_bounds(model, p)[s])]
            assert r["microbatch_bytes"] == sum(mlp_activation_formula(layers, 32 // m))
            assert r["peak_bytes"] == pl.in_flight_formula(name, s, p, m) * r["microbatch_bytes"], (name, m, s)
        assert vals[-1][name, m]["losses"] == pytest.approx(losses, abs=1e-5)


def _torch_schedules(data):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    out = {}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        def step(stage, xs, ys, m, cls=cls):
            rank, p = dist.get_rank(), dist.get_world_size()
            if not hasattr(stage, "schedule"):
                pipe = PipelineStage(stage, rank, p, torch.device("cpu"))
                stage.schedule = cls(pipe, n_microbatches=m, loss_fn=nn.functional.cross_entropy)
            args = (torch.cat(xs),) if rank == 0 else ()
            stage.schedule.step(*args, **({"target": torch.cat(ys)} if rank == p - 1 else {}))
        theirs = pl.train_stage(step, steps=STEPS, m=4, fwd_s=0.002, record=True, data=data)
        ours = pl.train_stage(lambda st, xs, ys, m, n=name: pl.run_order(
            st, pl.SCHEDULES[n](dist.get_rank(), dist.get_world_size(), m), xs, ys, m),
            steps=STEPS, m=4, fwd_s=0.002, record=True, data=data)
        out[name] = (theirs["params"], [a[:2] for a in pl.actions(theirs["events"])],
                     [a[:2] for a in pl.actions(ours["events"])])
    return out


def test_torch_pipelining_gives_our_weights_and_our_order_on_gloo():
    reference, _ = pl.train_reference(STEPS)
    vals = run(_torch_schedules, world_size=2, args=(load_digits(),), output="none", timeout=120).values
    for s, (v, want) in enumerate(zip(vals, pl.stage_params(reference, 2))):
        for name, (params, theirs, ours) in v.items():
            assert max_diff(params, want) <= sgd_atol(STEPS, 0.1, 32, 256), (name, s)
            assert theirs == ours == pl.SCHEDULES[name](s, 2, 4), (name, s)


def _interleaved_schedule(parts, m, v=2):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    stages = [PipelineStage(layers, stage_index=s, num_stages=dist.get_world_size() * v, device=torch.device("cpu"))
              for s, layers in parts.items()]
    return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=nn.functional.cross_entropy)


def test_interleaved_1f1b_trains_to_sgd_and_its_plan_replays_to_the_interleaved_bubble():
    from fractions import Fraction

    from course_lib.training import interleaved as il
    reference, _ = pl.train_reference(STEPS)
    vals = run(il.train_interleaved, world_size=2, args=(_interleaved_schedule, (2, 4), 2, load_digits(), STEPS),
               kwargs={"plans_for": (1, 5)}, output="none", timeout=120).values
    want = pl.stage_params(reference, 4)
    for v in vals:
        for m in (2, 4):
            assert all(max_diff(got, want[s]) <= sgd_atol(STEPS, 0.1, 32, 256) for s, got in v["params"][m].items())
    assert set(vals[0]["params"][2]) == {0, 2} and set(vals[1]["params"][2]) == {1, 3}      # rank r: r, r + p
    for m in (2, 4):
        timeline = il.replay(vals[0]["plans"][m], 2, 2)
        assert il.bubble(timeline, m) == Fraction(1, 2 * m + 1)
        per_round = m // max(1, m // 2)                                          # torch's _get_warmup_ops, + 1
        assert [il.warmup_forwards(t) for t in timeline] == [min(per_round + 2 * (1 - r) + 1, 2 * m)
                                                             for r in (0, 1)]
    assert vals[0]["plans_all"][5] is None and vals[0]["plans_all"][1] is not None   # m = 5: 2 rounds do not divide it
    with pytest.raises(RuntimeError, match="deadlocks"):
        il.replay({0: [("FULL_BACKWARD", 1, 0), ("FORWARD", 0, 0)], 1: [("FORWARD", 1, 0), ("FULL_BACKWARD", 1, 0)]},
                  2, 1)


def test_the_pipeline_lab_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "course_lib.labs.pipeline", "--schedule", "1f1b", "--steps", "2", "--stage-ms", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "[rank 0/2] stage 0 schedule=1f1b" in out.stdout and "[rank 1/2] stage 1 schedule=1f1b" in out.stdout
    assert "replayed from the recorded order: ['0.1111', '0.1111']" in out.stdout        # (2-1)/(8+2-1)
    assert out.stdout.count("(EQUAL)") == 3                                               # 2 stages' bytes, weights
