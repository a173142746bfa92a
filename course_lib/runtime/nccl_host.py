"""The NCCL-rules mode's host tensors: a tensor a factory made on the CPU, which would still be on the CPU on a GPU.

On NCCL, ``torch.ones(4)`` without ``device=`` stays in host memory and ``dist.all_reduce`` refuses it
("Tensors must be CUDA and dense", ProcessGroupNCCL's check_gpu_single_tensor). In the mode, the factories below
return a HostTensor subclass that remembers the learner's line; what is computed from host tensors alone stays
one, ``.to(device)`` or any op with a device tensor makes a plain tensor; nccl_rules.py refuses a host tensor in a
call (rule ``host-tensor``, docs/ARCHITECTURE.md section 7b).
"""

from __future__ import annotations

import sys

from .nccl_order import in_torch, learner_line

FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
             "eye", "tensor", "as_tensor", "from_numpy")

_host_cls: list = []
_AS_PLAIN = ("__repr__", "__str__", "__format__", "__reduce_ex__", "__deepcopy__", "tolist", "numpy", "item")


def host_class():
    """HostTensor: made by a factory without device=; what is computed from host tensors alone stays one."""
    if not _host_cls:
        import torch
        from torch.utils._pytree import tree_flatten

        class HostTensor(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in _AS_PLAIN:  # printing, pickling, leaving torch: exactly as a plain tensor does
                    return func(_plain(args[0]), *args[1:], **kwargs)
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                if name in ("to", "cuda") and (len(args) > 1 or "device" in kwargs):
                    return _plain(out)  # moved to the rank's device
                inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
                # On a GPU, an op with any tensor on the device (a 0-dim CPU scalar aside) runs on the device.
                if any(type(a) is not cls and a.dim() > 0 for a in inputs):
                    return out
                made = next((a._made_at for a in inputs if type(a) is cls), "a factory")
                if isinstance(out, torch.Tensor) and type(out) is not cls:
                    out = out.as_subclass(cls)
                    out._made_at = made
                elif isinstance(out, (tuple, list)) and type(out) in (tuple, list):
                    out = type(out)(_mark(o, cls, made) for o in out)
                return out

        _host_cls.append(HostTensor)
    return _host_cls[0]


def _mark(t, cls, made):
    import torch

    if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
        t = t.as_subclass(cls)
        t._made_at = made
    return t


def _plain(x):
    import torch

    if isinstance(x, torch.Tensor) and _host_cls and type(x) is _host_cls[0]:
        return x.as_subclass(torch.Tensor)
    return x


def factory(name: str, orig):
    def made(*args, **kwargs):
        t = orig(*args, **kwargs)
        caller = sys._getframe(1).f_code.co_filename
        explicit_cpu = kwargs.get("device") == "cpu"
        if ((kwargs.get("device") is None or explicit_cpu) and not t.requires_grad and t.device.type == "cpu"
                and not in_torch(caller)):
            t = t.as_subclass(host_class())
            t._made_at = f"torch.{name}(...) in {learner_line()}"
        return t

    made.__wrapped__ = orig
    return made


def made_any() -> bool:
    """A host tensor class exists in this rank (the mode made one)."""
    return bool(_host_cls)
