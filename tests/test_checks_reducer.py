"""Exercise 9.2's checker (checks/reducer.py) accepts a reducer that survives a parameter without a gradient, written
three ways, and refuses, each with its sentence: section 3's Reducer unchanged (buckets never all-reduced), torch's
DDP, one all-reduce per tensor, buckets concatenated and copied back instead of views, every bucket after backward,
buckets out of order, and leftover buckets that are not averaged. Reducer below is the class of the notebook's
section 3, copied."""

import pytest
import torch
import torch.distributed as dist

from course_lib.checks.core import ExerciseFailed
from course_lib.checks.reducer import check_reducer_with_unused_parameters
from course_lib.training.allreduce import buckets

SKIPPED_TOGETHER = r"^Exercise 9\.2: with 2 ranks that skip the branch on the same steps: rank 0, step 1 "


class Reducer:                                      # notebook 09, section 3
    def __init__(self, model, bucket_bytes):
        self.n = dist.get_world_size()
        self.groups = buckets(list(model.parameters()), bucket_bytes)
        self.flats, self.works = [], []
        for i, group in enumerate(self.groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i))
                offset += p.numel()
            self.flats.append(flat)
        self.zero_grad()

    def zero_grad(self):
        for flat in self.flats:
            flat.zero_()
        self.pending, self.next = [len(g) for g in self.groups], 0

    def grad_ready(self, i):
        self.pending[i] -= 1
        while self.next < len(self.groups) and self.pending[self.next] == 0:
            self.launch(self.next)

    def launch(self, i):
        self.flats[i] /= self.n
        self.works.append(dist.all_reduce(self.flats[i], async_op=True))
        self.next = i + 1

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []


# ------------------------------------------------------------------------------------------------ right, three ways
class LaunchTheRest(Reducer):                       # the worked solution: what is still waiting goes now, in order
    def wait(self):
        while self.next < len(self.groups):
            self.launch(self.next)
        super().wait()


class MarkUnusedReady(Reducer):                     # DDP's way: a parameter without a gradient is marked ready
    def __init__(self, model, bucket_bytes):
        super().__init__(model, bucket_bytes)
        self.fired = set()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.fired.add(p))

    def zero_grad(self):
        super().zero_grad()
        self.fired = set()

    def wait(self):
        for i, group in enumerate(self.groups):
            for p in group:
                if p not in self.fired:
                    self.fired.add(p)
                    self.grad_ready(i)
        super().wait()


class OneBuffer:                                    # written from scratch: every bucket a slice of one buffer
    def __init__(self, model, bucket_bytes):
        self.groups = buckets(list(model.parameters()), bucket_bytes)
        params = list(model.parameters())
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device)
        self.slices, start = [], 0
        for i, group in enumerate(self.groups):
            for p in group:
                p.grad = self.buffer[start:start + p.numel()].view_as(p)
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.ready(i))
                start += p.numel()
            self.slices.append(self.buffer[start - sum(p.numel() for p in group):start])
        self.zero_grad()

    def zero_grad(self):
        self.buffer.zero_()
        self.left, self.sent, self.handles = [len(g) for g in self.groups], 0, []

    def ready(self, i):
        self.left[i] -= 1
        self.send_ready()

    def send_ready(self, everything=False):
        while self.sent < len(self.slices) and (everything or self.left[self.sent] == 0):
            self.handles.append(dist.all_reduce(self.slices[self.sent], async_op=True))
            self.sent += 1

    def wait(self):
        self.send_ready(everything=True)
        for h in self.handles:
            h.wait()
        self.buffer /= dist.get_world_size()


def test_a_reducer_that_launches_what_is_left_in_order_passes_written_three_ways(capsys):
    for cls in (LaunchTheRest, MarkUnusedReady, OneBuffer):
        check_reducer_with_unused_parameters(cls)
    assert capsys.readouterr().out.count("✓ Exercise 9.2 passed") == 3


# ------------------------------------------------------------------------------------------------ wrong
class WithDDP(Reducer):                             # the shortcut: torch's own reducer
    def __init__(self, model, bucket_bytes):
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model, find_unused_parameters=True)


class PerTensor(Reducer):                           # right numbers, wrong method: one all-reduce per tensor
    def grad_ready(self, i):
        pass

    def wait(self):
        for group in self.groups:
            for p in group:
                dist.all_reduce(p.grad)
                p.grad /= self.n


class Concatenated(Reducer):                        # right numbers, wrong method: copies instead of views
    def __init__(self, model, bucket_bytes):
        super().__init__(model, bucket_bytes)
        self.params = list(model.parameters())

    def zero_grad(self):
        super().zero_grad()
        self.cat = {}
        for p in getattr(self, "params", []):
            p.grad = None

    def launch(self, i):
        flat = torch.cat([torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1)
                          for p in self.groups[i]]) / self.n
        self.cat[i] = flat
        self.works.append(dist.all_reduce(flat, async_op=True))
        self.next = i + 1

    def wait(self):
        while self.next < len(self.groups):
            self.launch(self.next)
        super().wait()
        for i, group in enumerate(self.groups):
            offset = 0
            for p in group:
                p.grad = self.cat[i][offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()


class AfterBackward(Reducer):                       # right numbers, wrong method: nothing overlaps backward
    def grad_ready(self, i):
        pass

    def wait(self):
        for i in range(len(self.groups)):
            self.launch(i)
        super().wait()


class OutOfOrder(Reducer):                          # each bucket as soon as it is full: ranks may disagree on order
    def grad_ready(self, i):
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self.launch(i)

    def launch(self, i):
        super().launch(i)
        self.launched = getattr(self, "launched", set()) | {i}

    def zero_grad(self):
        super().zero_grad()
        self.launched = set()

    def wait(self):
        for i in range(len(self.groups)):
            if i not in self.launched:
                self.launch(i)
        super().wait()


class NotAveraged(Reducer):                         # the leftover buckets summed, never divided
    def wait(self):
        while self.next < len(self.groups):
            self.works.append(dist.all_reduce(self.flats[self.next], async_op=True))
            self.next += 1
        super().wait()


def test_section_3s_reducer_unchanged_leaves_buckets_unreduced():
    with pytest.raises(ExerciseFailed, match=SKIPPED_TOGETHER + r"\(this rank skipped the branch\): only bucket\(s\) "
                                             r"\[0\] were all-reduced; bucket\(s\) \[1, 2\] never were"):
        check_reducer_with_unused_parameters(Reducer)


def test_ddp_is_switched_off():
    with pytest.raises(ExerciseFailed, match=r"Exercise 9\.2 is about a reducer whose buckets survive a parameter "
                                             r"without a gradient; torch's DistributedDataParallel is switched off"):
        check_reducer_with_unused_parameters(WithDDP)


def test_right_numbers_by_a_wrong_method_are_refused():
    with pytest.raises(ExerciseFailed, match=r"rank 0, step 0 \(this rank took the branch\): 6 all-reduces of "
                                             r"\[10, 320, 32, 1024, 32, 2048\] elements"):
        check_reducer_with_unused_parameters(PerTensor)
    with pytest.raises(ExerciseFailed, match=r"step 0 .*: p\.grad of \['first\.weight', 'first\.bias', "
                                             r"'branch\.weight', 'branch\.bias', 'last\.weight', 'last\.bias'\] is "
                                             r"not a view into a bucket that was all-reduced"):
        check_reducer_with_unused_parameters(Concatenated)
    with pytest.raises(ExerciseFailed, match=r"step 0 .*: bucket\(s\) \[0, 1, 2\] were all-reduced after backward\(\) "
                                             r"returned"):
        check_reducer_with_unused_parameters(AfterBackward)
    with pytest.raises(ExerciseFailed, match=SKIPPED_TOGETHER + r".*in bucket order\) were all-reduced in the order "
                                             r"\[330, 2080, 1056\]"):
        check_reducer_with_unused_parameters(OutOfOrder)


def test_leftover_buckets_must_be_averaged_too():
    with pytest.raises(ExerciseFailed, match=r"with 2 ranks that skip the branch on the same steps, the weights differ "
                                             r"from single-process SGD"):
        check_reducer_with_unused_parameters(NotAveraged)
