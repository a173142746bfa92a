"""Notebook 14b's checkers refuse what they must and accept correct answers written otherwise.

14b.1 (loss scaling across pipeline stages): torch's GradScaler (named as torch's) and FSDP's ShardedGradScaler, a
pure-Python copy of GradScaler's rules on CPU, are switched off; a SUM of flags read as "exactly one stage overflowed"
fails where two stages, or all, overflow at once; a collective over the gradients themselves (the data-parallel habit)
fails on stages of different shapes. 14b.2 (selective recomputation): (a) the shortcuts, full recomputation and
torch's own list of ops worth saving, (b) a policy tuned to the checker's sizes, (c) keeping every matrix product (the
s² scores) are refused; (d) a list of ops, Korthikanti et al.'s region, and a policy that also keeps attention's
second product pass.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.loss_scaling import check_loss_scaling
from course_lib.checks.recomputation import check_selective_policy

A = torch.ops.aten


# ---------------------------------------------------------------------------------------------- 14b.1
def _by_fsdps_scaler(stage, lr, scaler):        # its own flag, then ShardedGradScaler's CPU rule for the scale
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    bad = torch.tensor([float(not all(torch.isfinite(q.grad).all() for q in stage.parameters()))],
                       device=stage.weight.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    sgs = ShardedGradScaler(device="cpu", init_scale=scaler["scale"], growth_interval=scaler["growth_interval"])
    sgs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    sgs._growth_tracker.fill_(scaler["good_steps"])
    scale = scaler["scale"]
    sgs._amp_update_scale_cpu_(bad.cpu())
    scaler["scale"], scaler["good_steps"] = sgs._scale.item(), int(sgs._growth_tracker.item())
    if bad.item():
        return False
    with torch.no_grad():
        for q in stage.parameters():
            q -= lr * q.grad / scale
    return True


def _apply_scaler(stage, lr, scaler, ok):      # GradScaler's rules once a wrong method has decided whether to step
    if not ok:
        scaler["scale"] *= 0.5
        scaler["good_steps"] = 0
        return False
    with torch.no_grad():
        for q in stage.parameters():
            q -= lr * q.grad / scaler["scale"]
    scaler["good_steps"] += 1
    if scaler["good_steps"] == scaler["growth_interval"]:
        scaler["scale"] *= 2
        scaler["good_steps"] = 0
    return True


def _whole_gradient_summed(stage, lr, scaler):  # DDP's habit: all-reduce a copy of every gradient, test the sum
    flat = torch.cat([q.grad.reshape(-1) for q in stage.parameters()]).clone()
    dist.all_reduce(flat)
    return _apply_scaler(stage, lr, scaler, bool(torch.isfinite(flat).all()))


def test_14b_1_refuses_fsdps_sharded_scaler():
    with pytest.raises(ExerciseFailed, match=r"torch's ShardedGradScaler\._amp_update_scale_cpu_ is switched off"):
        check_loss_scaling(_by_fsdps_scaler)


def test_14b_1_refuses_a_collective_over_the_gradients_of_stages_of_different_shapes():
    with pytest.raises(ExerciseFailed, match=r"failed with 2 stages \(each stage's weight has its own shape"):
        check_loss_scaling(_whole_gradient_summed)


def _exactly_one_flag(stage, lr, scaler):      # SUM of 0/1 flags read as "== 1": steps when two stages overflow
    flag = torch.tensor([float(not all(torch.isfinite(q.grad).all() for q in stage.parameters()))],
                        device=stage.weight.device)
    dist.all_reduce(flag)
    return _apply_scaler(stage, lr, scaler, flag.item() != 1.0)


def _by_torchs_grad_scaler(stage, lr, scaler):  # torch's GradScaler does the unscale, the check and the update
    gs = torch.amp.GradScaler("cpu", init_scale=scaler["scale"], growth_interval=scaler["growth_interval"])
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    gs.unscale_(opt)
    gs.step(opt)
    gs.update()
    return True


def test_14b_1_refuses_a_sum_of_flags_read_as_exactly_one():
    with pytest.raises(ExerciseFailed, match=r"step 8: your step ran; it should be skipped \(a weight gradient on "
                                             r"stage 0 is inf and a bias gradient on stage 1 is nan\)"):
        check_loss_scaling(_exactly_one_flag)


def test_14b_1_names_torchs_grad_scaler_as_torchs():
    with pytest.raises(ExerciseFailed, match=r"torch's GradScaler\.unscale_ is switched off here") as e:
        check_loss_scaling(_by_torchs_grad_scaler)
    assert "course's own" not in str(e.value)


# ---------------------------------------------------------------------------------------------- 14b.2
def _keep(*ops):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _torchs_compute_intensive_ops(ctx, op, *args, **kwargs):
    from torch._functorch.partitioners import get_default_op_list

    keep = get_default_op_list().compute_intensive_ops
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in keep else CheckpointPolicy.PREFER_RECOMPUTE


def _tuned_to_one_size(ctx, op, *args, **kwargs):   # recomputes what has the first case's score size, keeps the rest
    out_numel = 16 * 64 * 64                          # b·a x s x s at s = 64, b = 4, a = 4
    if op is A.bmm.default and args[0].shape[0] * args[0].shape[1] * args[1].shape[-1] == out_numel:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in (A._softmax.default, A.mul.Tensor, A.bernoulli_.float, A.div_.Scalar, A.empty_like.default):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


_CORE_ATTENTION = {A.bmm.default, A._softmax.default, A.mul.Tensor, A.bernoulli_.float, A.div_.Scalar,
                   A.empty_like.default}


def _korthikanti_region(ctx, op, *args, **kwargs):  # recompute the core attention's ops, keep everything else
    return CheckpointPolicy.PREFER_RECOMPUTE if op in _CORE_ATTENTION else CheckpointPolicy.MUST_SAVE


def _keeps_the_context_too(ctx, op, *args, **kwargs):  # also keeps probs @ V (s x d per head): one product less
    if op is A.bmm.default and args[1].shape[-1] != args[1].shape[-2]:
        score_like = args[0].shape[-1] == args[0].shape[-2]         # (s x s) @ (s x d): attention over V
        return CheckpointPolicy.MUST_SAVE if score_like else CheckpointPolicy.PREFER_RECOMPUTE
    return _keep(A.mm.default, A.addmm.default)(ctx, op, *args, **kwargs)


@pytest.mark.parametrize("shortcut", [_recompute_everything, _torchs_compute_intensive_ops])
def test_14b_2_refuses_the_shortcuts(shortcut):
    with pytest.raises(ExerciseFailed, match=r"recomputes some of them|grows with s²"):
        check_selective_policy(shortcut)


def test_14b_2_refuses_full_recomputation_by_its_flops():
    with pytest.raises(ExerciseFailed, match=r"the Linear layers' products .* your policy recomputes some of them"):
        check_selective_policy(_recompute_everything)


def test_14b_2_refuses_a_policy_tuned_to_the_checkers_size():
    with pytest.raises(ExerciseFailed, match=r"at s = 128: .* not 2\. Something it keeps grows with s²"):
        check_selective_policy(_tuned_to_one_size)


def test_14b_2_refuses_keeping_every_matrix_product():
    with pytest.raises(ExerciseFailed, match=r"keeps 3,407,872 B for backward, and 7,864,320 B at s = 128"):
        check_selective_policy(_keep(A.mm.default, A.addmm.default, A.bmm.default))


def _saves_by_default(ctx, op, *args, **kwargs):   # recompute the s² ops, keep the rest: CPU dropout's noise is kept
    recompute = (A.bmm.default, A._softmax.default)   # and then written in place, which torch refuses
    return CheckpointPolicy.PREFER_RECOMPUTE if op in recompute else CheckpointPolicy.MUST_SAVE


def test_14b_2_names_the_in_place_op_when_a_kept_output_is_mutated():
    with pytest.raises(ExerciseFailed, match=r"has been mutated.*cannot be kept: on a CPU, dropout makes its noise"):
        check_selective_policy(_saves_by_default)


def test_14b_2_says_what_base_its_flop_share_is_of(capsys):
    check_selective_policy([A.mm.default, A.addmm.default])
    assert "matrix FLOPs of forward + backward +2.6% at s/h = 64/128" in capsys.readouterr().out


@pytest.mark.parametrize("policy", [[A.mm.default, A.addmm.default], _korthikanti_region, _keeps_the_context_too],
                         ids=["a list of ops", "korthikanti's region", "keeps attention over V"])
def test_14b_2_accepts_correct_policies_written_otherwise(policy, capsys):
    check_selective_policy(policy)
    assert "✓ Exercise 14b.2" in capsys.readouterr().out
