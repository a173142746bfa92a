"""Join the process group torchrun describes: its environment, NCCL on the worker's own GPU or gloo (notebook 17)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..runtime.devices import node_gpu, node_gpus
from ..runtime.results import LaunchError

# The restart race (data/restart_trials_2core.csv: with the shared store 8 of 10 single-node gloo runs met the dead
# worker's address; 5 finished, 3 hung, 2 used up their restarts): by default torchrun's workers
# share the agent's TCPStore, which outlives a restart. gloo publishes each rank's listening address under the
# same key in every attempt, so a restarted rank can read the dead worker's address before its successor
# overwrites it and gets "Connection refused", which costs one more restart. torch's own opt-out gives every
# rendezvous round a fresh store on a fresh port: launch torchrun with this variable set to 1.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass
class Env:
    """One worker's view of the job, read from torchrun's environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int  # the node's rank: torchrun's --node-rank with static rendezvous; with c10d the order of the
    # sorted node descriptors (--local-addr or else the host's FQDN, then the agent's pid: dynamic_rendezvous)
    master_addr: str
    master_port: int
    restart: int  # how many times this node's agent has restarted its workers
    host: str

    @classmethod
    def read(cls) -> Env:
        env = {**_from_slurm(os.environ), **os.environ}          # torchrun's variables win where both are set
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise SystemExit(f"{', '.join(missing)} not set: start the lab with torchrun, "
                             "e.g. `torchrun --nproc-per-node=2 -m course_lib.labs.hello`, or with one srun task "
                             "per GPU and MASTER_ADDR, MASTER_PORT exported (notebook 17, section 3)")
        g = env.get
        return cls(rank=int(g("RANK")), local_rank=int(g("LOCAL_RANK", "0")), world_size=int(g("WORLD_SIZE")),
                   local_world_size=int(g("LOCAL_WORLD_SIZE", "1")), group_rank=int(g("GROUP_RANK", "0")),
                   master_addr=g("MASTER_ADDR"), master_port=int(g("MASTER_PORT")),
                   restart=int(g("TORCHELASTIC_RESTART_COUNT", "0")), host=socket.gethostname())


def _from_slurm(environ) -> dict:
    """torchrun's names for what srun tells each of its tasks (one task per GPU, no torchrun: Slurm's srun docs)."""
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return {}
    per_node = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"), "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
            "LOCAL_WORLD_SIZE": per_node.split("(")[0].split(",")[0]}   # "4(x2)": 4 tasks on each of 2 nodes


def choose(local_rank: int, local_world_size: int, backend: str = "auto") -> tuple[str, torch.device]:
    """NCCL when this node has a GPU for each of its workers, worker LOCAL_RANK on the node's GPU number LOCAL_RANK
    (devices.node_gpu: cuda:LOCAL_RANK, or the node's own list in LAB_GPUS when "nodes" share a machine); else gloo."""
    if backend == "auto":
        # Decided from the node's worker count, not this rank's index, so the ranks of one node agree (3 workers
        # on 2 GPUs would otherwise give NCCL to ranks 0-1 and gloo to rank 2). Across nodes nothing here makes
        # them agree: every node must have a GPU for each of its workers, or none may use them (one torchrun with
        # 2 workers on 2 GPUs and one with 1 worker on none would mix NCCL and gloo in one group, which cannot
        # start). Nodes sharing one machine get their own GPUs, or none, from LAB_GPUS (torchrun.split_gpus).
        enough = dist.is_nccl_available() and len(node_gpus()) >= local_world_size
        backend = "nccl" if enough else "gloo"
    if backend == "nccl":
        try:
            gpu = node_gpu(local_rank)
        except LaunchError as e:
            raise SystemExit(f"backend nccl: {e}") from None
        torch.cuda.set_device(gpu)  # before the first collective, or NCCL may pick GPU 0 on every rank
        return backend, torch.device("cuda", gpu)
    return backend, torch.device("cpu")


def join(timeout_s: float = 60.0, backend: str | None = None) -> tuple[Env, str, torch.device]:
    """init_process_group from torchrun's env://, with a timeout far below the defaults (30 min gloo, 10 min NCCL)."""
    env = Env.read()
    backend, dev = choose(env.local_rank, env.local_world_size, backend or os.environ.get("LAB_BACKEND", "auto"))
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None)
        # A rank that finishes joining closes nothing yet, but a fast rank could otherwise leave while a slow peer
        # is still connecting; one barrier makes "joined" mean "every pair connected".
        dist.barrier()
    except Exception as e:  # say which known cause this is, then fail: torchrun restarts the group if it may
        hint = ""
        if "refused" in str(e) and env.restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            hint = (f" [restart {env.restart}: a peer's address from the previous attempt was still in torchrun's "
                    f"shared store; launch torchrun with {FRESH_STORE_ENV}=1 so each restart gets a fresh store]")
        print(f"rank {env.rank}: joining the process group failed: {type(e).__name__}: {e}{hint}",
              file=sys.stderr, flush=True)
        raise
    return env, backend, dev


def say(text: str) -> None:
    """Print one line in a single write: the workers of a node share torchrun's stdout, and with PYTHONUNBUFFERED a
    print() is two writes (text, then newline), so two ranks' lines could run together."""
    os.write(1, (text + "\n").encode())


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
