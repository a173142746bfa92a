"""Exercises 17.1 and 17.2 (notebooks/17_multi_node_lab.ipynb): each checker refuses the library shortcut, a wrong
method that gives the right numbers on the easy cases, and a wrong result, and accepts correct answers written
differently."""

import numpy as np
import pytest

from course_lib.checks import multi_node
from course_lib.checks.core import ExerciseFailed


def line(nnodes, node_rank, gpus, head, port):
    return (f"torchrun --nnodes {nnodes} --node_rank={node_rank} --nproc-per-node={gpus} --rdzv-backend=c10d "
            f"--rdzv-endpoint={head}:{port} hello_worker.py")


def test_17_1_accepts_every_spelling_torchrun_reads_the_same():
    multi_node.check_torchrun_line(line)
    # c10d ranks the nodes itself: --node-rank left out (or 0 everywhere) passes
    multi_node.check_torchrun_line(lambda *a: line(*a).replace(f"--node_rank={a[1]} ", ""))
    multi_node.check_torchrun_line(lambda *a: line(a[0], 0, *a[2:]))
    # min:max with min = max is the same fixed number of nodes; python -m, srun/env prefixes, a folder, --rdzv-id
    multi_node.check_torchrun_line(lambda *a: line(*a).replace(f"--nnodes {a[0]}", f"--nnodes={a[0]}:{a[0]}"))
    multi_node.check_torchrun_line(lambda *a: "srun NCCL_DEBUG=INFO python -m torch.distributed.run "
                                   + line(*a).split(" ", 1)[1].replace("hello_worker.py",
                                                                       "--rdzv-id=7 exported/hello_worker.py"))


def test_17_1_refuses_the_library_shortcut():
    def from_the_course(nnodes, node_rank, gpus, head, port):
        from course_lib.labs import torchrun

        return " ".join(torchrun.command("hello_worker.py", nproc=gpus, nnodes=nnodes, host=head, port=port))

    with pytest.raises(ExerciseFailed, match=r"labs\.torchrun\.command \(it holds the answer\) is switched off"):
        multi_node.check_torchrun_line(from_the_course)


def test_17_1_refuses_the_one_machine_line_that_parses_right():
    # (b) every field torchrun checks is right, but the loopback stand-ins would break a real cluster
    with pytest.raises(ExerciseFailed, match=r"--local-addr=127\.0\.0\.1 makes this node advertise a loopback"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("hello", "--local-addr=127.0.0.1 hello"))
    with pytest.raises(ExerciseFailed, match=r"decides by hand which torchrun hosts the rendezvous store"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("hello", f"--rdzv-conf=is_host={int(a[1] == 0)} "
                                                                            "hello"))
    # --standalone parses with the right fields, but torchrun then replaces the endpoint by localhost:0 (run.py)
    with pytest.raises(ExerciseFailed, match=r"--standalone makes torchrun start a rendezvous of its own"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("torchrun", "torchrun --standalone"))


def test_17_1_refuses_the_head_as_every_nodes_own_address():
    # (c) --local-addr is what this node advertises, not the rendezvous: the head's address on every node is wrong
    with pytest.raises(ExerciseFailed, match=r"--local-addr=10\.0\.0\.1 is the address this node tells the others"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("hello", f"--local-addr={a[3]} hello"))
    with pytest.raises(ExerciseFailed, match=r"--local-addr=0\.0\.0\.0 is the address"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("hello", "--local-addr=0.0.0.0 hello"))


def test_17_1_accepts_a_word_list():
    # (d) the same command as subprocess takes it
    multi_node.check_torchrun_line(lambda *a: line(*a).split())


def test_17_1_refuses_wrong_lines():
    with pytest.raises(ExerciseFailed, match=r"torchrun reads --node-rank as 2") as e:
        multi_node.check_torchrun_line(lambda *a: line(a[0], a[1] + 1, *a[2:]))
    assert "which one it is" not in str(e.value)
    with pytest.raises(ExerciseFailed, match=r"torchrun's argument parser refuses it"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("--nnodes", "--nodes"))
    with pytest.raises(ExerciseFailed, match=r"--nproc-per-node as '8'"):   # the job's total, not the node's
        multi_node.check_torchrun_line(lambda *a: line(a[0], a[1], a[0] * a[2], *a[3:]))
    with pytest.raises(ExerciseFailed, match=r"--nnodes as '2:3'"):          # elastic, not two nodes
        multi_node.check_torchrun_line(lambda *a: line(*a).replace(f"--nnodes {a[0]}", f"--nnodes={a[0]}:{a[0] + 1}"))
    with pytest.raises(ExerciseFailed, match=r"program as '-m course_lib.labs.hello'"):
        multi_node.check_torchrun_line(lambda *a: line(*a).replace("hello_worker.py", "-m course_lib.labs.hello"))


def rank(node, local, nprocs):
    return sum(nprocs[:node]) + local


def test_17_2_accepts_correct_answers_written_differently():
    multi_node.check_global_rank(rank, lambda node, nprocs: [rank(node, k, nprocs) for k in range(nprocs[node])])
    multi_node.check_global_rank(lambda node, local, nprocs: int(np.cumsum([0, *nprocs])[node]) + local,
                                 lambda node, nprocs: range(sum(nprocs[:node]), sum(nprocs[:node + 1])))
    multi_node.check_global_rank(lambda node, local, nprocs: np.int64(sum(nprocs[:node]) + local),
                                 lambda node, nprocs: tuple(np.arange(sum(nprocs[:node]), sum(nprocs[:node + 1]))))


def test_17_2_refuses_the_even_nodes_formula_and_wrong_results():
    # (b) node x workers-per-node + local: right whenever every node runs the same number of workers
    with pytest.raises(ExerciseFailed, match=r"node 1, local rank 0, workers per node \[2, 1\]: you said 1"):
        multi_node.check_global_rank(lambda node, local, nprocs: node * nprocs[node] + local)
    with pytest.raises(ExerciseFailed, match=r"workers per node \[4, 4\]: you said 0"):
        multi_node.check_global_rank(lambda node, local, nprocs: local)
    with pytest.raises(ExerciseFailed, match=r"a rank is an int"):
        multi_node.check_global_rank(lambda node, local, nprocs: float(rank(node, local, nprocs)))
    with pytest.raises(ExerciseFailed, match=r"the ranks on node 0 with workers per node \[4, 4\]: you said \[0, 2\]"):
        multi_node.check_global_rank(rank, lambda node, nprocs: [rank(node, k, nprocs) for k in range(0, 4, 2)])
    with pytest.raises(ExerciseFailed, match=r"the ranks on node 1 with workers per node \[2, 1\]"):
        multi_node.check_global_rank(rank, lambda node, nprocs: [node * nprocs[node] + k for k in range(nprocs[node])])
