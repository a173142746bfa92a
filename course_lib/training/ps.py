"""A parameter server (参数服务器) over point-to-point messages: synchronous, asynchronous, sharded over k servers.

Taught in notebooks/08_parameter_server.ipynb (built there cell by cell first; this is the reference version).
Ranks 0..k-1 are servers, each owning one contiguous shard of the flat parameter vector (chunk_bounds, as the
ring's chunks); ranks k..world-1 are workers, each with its own data shard. Synchronous (Li et al., OSDI'14, with a
full barrier per step): workers pull, compute, push; each server waits for all n gradients, averages, updates.
Asynchronous: a server applies each gradient when it arrives and answers that worker at once; the staleness of a
gradient = server updates since that worker last pulled. Colocated (every rank a worker and the server of one
shard, as BytePS, Jiang et al. OSDI'20, compares with all-reduce): a shard's own gradient and weights never leave
their machine. Every message is dist.send/recv/isend/irecv, so traffic.metered and
emulated_link.emulate see all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import device
from ..collectives import chunk_bounds
from ..measure import emulated_link
from ..measure.emulated_link import emulate
from ..measure.timeline import Timeline, region
from ..measure.traffic import Meter, metered
from .data import load_digits, worker_batch
from .model import flat_grads, flat_params, make_mlp, set_flat_params
from .worker_loop import forward_backward, worker_steps


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _sync_server(shard, workers, steps, lr, meter):
    n = len(workers)
    grads = [torch.empty_like(shard) for _ in workers]
    for _ in range(steps):
        with region("comm", "send params"):
            _wait([dist.isend(shard, w) for w in workers])
        with region("wait", "gather grads"):
            _wait([dist.irecv(g, w) for g, w in zip(grads, workers)])
        with region("compute", "update"):
            shard -= lr * (torch.stack(grads).sum(0) / n)
        meter.step()
    with region("comm", "send final params"):       # the final pull: every worker ends with the final weights
        _wait([dist.isend(shard, w) for w in workers])
    return {}


def _async_server(shard, workers, steps, lr, meter):
    """Apply gradients in arrival order; each message carries the version (update count) it was computed from."""
    n = len(workers)
    version = 0
    msg = torch.cat([shard, torch.zeros(1, device=shard.device)])
    inbox = torch.empty_like(msg)
    for w in workers:
        dist.isend(msg, w).wait()
    meter.skip()
    staleness = []
    for _ in range(n * steps):
        with region("wait", "any gradient"):
            w = dist.recv(inbox)   # no src: whichever worker's gradient comes first (gloo; NCCL has no any-source)
        with region("compute", "update"):
            staleness.append((w, version - int(inbox[-1].item())))
            shard -= (lr / n) * inbox[:-1]   # lr/n: n arrivals move the weights as far as one sync step
            version += 1
            msg[:-1], msg[-1] = shard, version
        with region("comm", "send params"):
            dist.isend(msg, w).wait()
        meter.step()
    return {"staleness": staleness}


def _pull(flat, bounds, servers, bufs, versions):
    """Every server's shard into its place in `flat` (async: with the version it was sent at)."""
    _wait([dist.irecv(b, s) for b, s in zip(bufs, servers)])
    for i, ((lo, hi), b) in enumerate(zip(bounds, bufs)):
        flat[lo:hi] = b[:hi - lo]
        if b.numel() > hi - lo:
            versions[i] = b[-1].item()


def _push_pull(g, flat, bounds, servers, bufs, versions):
    """A worker's side of one step after its backward: shard i of the gradient to server i, then pull them all."""
    extra = bufs[0].numel() - (bounds[0][1] - bounds[0][0])
    with region("comm", "push grads"):
        msgs = [torch.cat([g[lo:hi], torch.full((extra,), versions[i], device=g.device)])
                for i, (lo, hi) in enumerate(bounds)]
        _wait([dist.isend(m, s) for m, s in zip(msgs, servers)])
    with region("wait", "pull"):
        _pull(flat, bounds, servers, bufs, versions)


def _push_pull_pieces(g, flat, bounds, servers, pieces):
    """The same step cut into `pieces` per server shard (BytePS's partitions, Jiang et al. OSDI'20): every push and
    every pull posted at once, so a piece the server has already summed comes back while later ones still go out."""
    with region("comm", "push and pull pieces"):
        parts = [(s, lo + a, lo + b) for s, (lo, hi) in zip(servers, bounds) for a, b in chunk_bounds(hi - lo, pieces)]
        pushes = [dist.isend(g[a:b], s) for s, a, b in parts]
        _wait(pushes + [dist.irecv(flat[a:b], s) for s, a, b in parts])


def _worker(model, bounds, servers, steps, batch_size, seed, mode, meter, wid, n, data=None, compute_s=None,
            pieces=1):
    x, y = load_digits() if data is None else data
    dev = next(model.parameters()).device
    flat = flat_params(model)
    extra = 1 if mode == "async" else 0
    bufs = [torch.empty(hi - lo + extra, device=dev) for lo, hi in bounds]
    versions = [0] * len(servers)
    cost = compute_s[wid] if isinstance(compute_s, (list, tuple)) else compute_s   # one per worker, or one for all

    def push_pull(step: int):
        g = flat_grads(model)
        if pieces > 1:
            _push_pull_pieces(g, flat, bounds, servers, pieces)
        else:
            _push_pull(g, flat, bounds, servers, bufs, versions)
        set_flat_params(model, flat)

    with region("wait", "pull"):
        _pull(flat, bounds, servers, bufs, versions)
        set_flat_params(model, flat)
    meter.skip()   # the first pull is not part of any step
    losses, step_s = worker_steps(steps, lambda step: worker_batch(x, y, wid, n, batch_size, step, seed),
                                  lambda xb, yb: forward_backward(model, xb, yb, cost), push_pull, meter)
    return {"losses": losses, "step_s": step_s}


def _exchange(out: dict, into: dict) -> None:
    """Send out[j] to and receive into[j] from every peer j, one peer at a time in rank order, the lower rank of a
    pair sending first: an order in which no rank waits on one that waits on it, even where a send blocks until its
    receive is posted (NCCL's unbatched send/recv, gloo's rendezvous)."""
    me = dist.get_rank()
    for j in sorted(out):
        if me < j:
            dist.send(out[j], j)
            dist.recv(into[j], j)
        else:
            dist.recv(into[j], j)
            dist.send(out[j], j)


def _colocated(model, bounds, steps, batch_size, lr, seed, meter, data, compute_s):
    """Every rank a worker and the server of shard `rank`: its own piece of the gradient and of the weights stays on
    its machine. For counting bytes: its pairs take turns, so its time on a link is not a schedule worth timing."""
    me, n = dist.get_rank(), dist.get_world_size()
    dev = next(model.parameters()).device
    flat = flat_params(model)
    lo, hi = bounds[me]
    peers = [j for j in range(n) if j != me]
    cost = compute_s[me] if isinstance(compute_s, (list, tuple)) else compute_s
    x, y = data

    def serve_my_shard(step: int):
        g = flat_grads(model)
        pieces = {j: torch.empty(hi - lo, device=dev) for j in peers}
        with region("comm", "push grads"):     # shard j of my gradient to server j; shard `me` of theirs to me
            _exchange({j: g[a:b] for j, (a, b) in enumerate(bounds) if j != me}, pieces)
        with region("compute", "update"):      # the mean of the n gradients, in worker order
            pieces[me] = g[lo:hi]
            flat[lo:hi] -= lr * (torch.stack([pieces[j] for j in range(n)]).sum(0) / n)
        with region("comm", "pull"):           # my new shard to every worker; theirs into place
            _exchange({j: flat[lo:hi] for j in peers}, {j: flat[a:b] for j, (a, b) in enumerate(bounds) if j != me})
        set_flat_params(model, flat)

    losses, _ = worker_steps(steps, lambda step: worker_batch(x, y, me, n, batch_size, step, seed),
                             lambda xb, yb: forward_backward(model, xb, yb, cost), serve_my_shard, meter)
    return {"losses": losses}


def ps_train(steps: int = 10, n_servers: int = 1, batch_size: int = 32, lr: float = 0.1, hidden: int = 256,
             seed: int = 0, mode: str = "sync", link=None, profile: bool = False,
             compute_s: float | list[float] | None = None, server=None, colocated: bool = False,
             pieces: int = 1) -> dict:
    """Run on every rank (course_lib.run or torchrun): ranks < n_servers serve, the rest train.

    Returns this rank's role, final flat parameters (workers: the model; servers: their shard), per-step bytes
    (sent, received), per-step seconds and losses (workers), staleness (async servers), and timeline events.
    `link`: an emulated link (or its name) that every message crosses, timed on its virtual clock; `compute_s`: a
    fixed emulated cost added to each worker's forward+backward (a list: one per worker); `profile`: record the
    timeline; `server(shard, workers, steps, lr)`: a server loop written in a notebook (08's async_server) in place
    of the built-in one; `colocated`: every rank is a worker and the server of shard `rank` (n_servers unused);
    `pieces`: workers push and pull each server's shard in this many pieces, all posted at once, for a `server`
    that sums piece by piece (notebook 10's pipelined server).
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if colocated and (mode != "sync" or server is not None):
        raise ValueError("the colocated parameter server is synchronous, with its built-in server")
    if mode == "async" and dist.get_backend() != "gloo":
        raise ValueError("the asynchronous server receives from any source, which only gloo supports; use sync")
    if pieces != 1 and (server is None or mode != "sync" or colocated):
        raise ValueError("pieces > 1 needs a synchronous server written to sum piece by piece, passed as server=")
    rank, world = dist.get_rank(), dist.get_world_size()
    k = world if colocated else n_servers
    if not colocated and not 1 <= k < world:
        raise ValueError(f"need 1 <= n_servers < world size ({world}) so that at least one worker remains")
    dev = device()
    model = make_mlp(hidden, seed).to(dev)   # same seed: every rank starts from the same weights
    flat = flat_params(model)
    bounds = chunk_bounds(flat.numel(), k)
    servers, workers = list(range(k)), list(range(k, world))
    meter, tl = Meter(), Timeline(profile)
    # Workers read the digits before the clock starts, so the timeline's first bars are messages, not file reading.
    data = load_digits() if rank >= k or colocated else None
    with emulate(link), metered(meter), tl:
        if colocated:
            out = _colocated(model, bounds, steps, batch_size, lr, seed, meter, data, compute_s)
            out.update(role="colocated", params=flat_params(model))
        elif rank < k:
            lo, hi = bounds[rank]
            shard = flat[lo:hi].clone()
            if server is not None:      # the notebook's own loop: it counts no steps, so traffic stays empty
                out = dict(server(shard, workers, steps, lr) or {})
            else:
                out = (_sync_server if mode == "sync" else _async_server)(shard, workers, steps, lr, meter)
            out.update(role="server", params=shard)
        else:
            out = _worker(model, bounds, servers, steps, batch_size, seed, mode, meter, rank - k, len(workers),
                          data, compute_s, pieces)
            out.update(role="worker", params=flat_params(model))
    out.update(traffic=meter.steps, timeline=tl.events, model_bytes=flat.numel() * flat.element_size(),
               link_busy=emulated_link.link_busy() if link is not None else {})
    return out
