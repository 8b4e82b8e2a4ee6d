"""Data parallel through the engine: ranks started by torchrun (gloo, this machine) train
their shares of each batch; the result is one process's with the same global batch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from offload import batch_share
from offload._parallel import weights_fingerprint
from scripts.netns import LINKS, TwoNodes, usable
from tests.offload import _dp_proc
from tests.offload._factories import assert_same_weights, make_batch
from worker.distributed.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    cmd = torchrun_command(args[0], ranks, module="tests.offload._dp_proc")
    return subprocess.run([*cmd, *args[1:]], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=240, check=False)


def _one_process(mode: str, tmp_path: Path, rows: int, micro: int) -> dict:
    torch.set_num_threads(1)
    eng = _dp_proc.engine(mode, _dp_proc.build(mode), str(tmp_path / "one"), parallel=False)
    assert eng.streaming
    losses = [eng.step(b, micro_batches=micro) for b in _dp_proc.batches(STEPS, rows)]
    out = {"losses": losses, "weights": eng.model_state_dict()}
    eng.close()
    return out


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_ranks_are_bitwise_one_process_with_two_micro_batches(tmp_path, mode):
    run = _torchrun(2, mode, str(tmp_path / "swap"), str(tmp_path / "out.pt"), str(STEPS), "4")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = torch.load(tmp_path / "out.pt", weights_only=True)
    one = _one_process(mode, tmp_path, rows=4, micro=2)
    assert ranks["losses"] == one["losses"]
    assert_same_weights(one["weights"], ranks["weights"])
    moved = _dp_proc.build(mode).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in ranks["weights"].items())


def test_three_ranks_match_one_process_up_to_reduction_order(tmp_path):
    """Three shares of two rows: gloo may add them in another order than a process adds
    its micro-batches, so equal within float32 rounding, not bitwise: the losses within
    1e-6, each weight tensor within 1e-5 of its norm after 4 steps (measured 1.9e-6:
    Adam divides by sqrt(v), so the rounding of a gradient element near 0 grows)."""
    run = _torchrun(3, "full", str(tmp_path / "swap"), str(tmp_path / "out.pt"), str(STEPS), "6")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = torch.load(tmp_path / "out.pt", weights_only=True)
    one = _one_process("full", tmp_path, rows=6, micro=3)
    assert ranks["losses"] == pytest.approx(one["losses"], rel=1e-6)
    worst = max(float((ranks["weights"][k] - w).norm() / w.norm())
                for k, w in one["weights"].items())
    print(f"3 ranks vs 1 process: largest tensor difference {worst:.2e} of its norm")
    assert worst < 1e-5


@pytest.mark.skipif(usable() is not None, reason=str(usable()))
def test_two_nodes_over_a_slow_link_are_bitwise_one_process(tmp_path):
    """Two machines: this network namespace and another, joined by a veth shaped to
    1 Gbit/s; a c10d rendezvous on node A's address, gloo pinned to each node's veth. The
    gradients cross the link (its byte counters) and the result is one process's."""
    args = ["full", str(tmp_path / "swap"), str(tmp_path / "out.pt"), str(STEPS), "4"]
    with TwoNodes(LINKS[1]) as nodes:
        def node(addr: str) -> list[str]:
            cmd = torchrun_command(args[0], 1, nnodes=2, endpoint=nodes.rendezvous,
                                   run_id="two-nodes", local_addr=addr,
                                   module="tests.offload._dp_proc")
            return [*cmd, *args[1:]]

        codes, errors, crossed = nodes.run_on_both(node, ENV, ROOT, 240)
    assert codes == [0, 0], "\n".join(errors)
    ranks = torch.load(tmp_path / "out.pt", weights_only=True)
    one = _one_process("full", tmp_path, rows=4, micro=2)
    assert ranks["losses"] == one["losses"]
    assert_same_weights(one["weights"], ranks["weights"])
    grads = sum(w.numel() * 4 for w in one["weights"].values())
    assert crossed > STEPS * grads  # every step's gradients went over the link


@pytest.mark.skipif(usable() is not None, reason=str(usable()))
def test_two_runs_side_by_side_get_links_of_their_own():
    """Test processes side by side (pytest -n) may start from the same number: the second
    takes the next free one and leaves the first one's link alone."""
    with TwoNodes(LINKS[0]) as first, TwoNodes(LINKS[0], n=first.n) as second:
        assert second.n != first.n
        for nodes in (first, second):  # both links whole, each end with its own address
            for prefix, dev, addr in (([], nodes.dev_a, nodes.addr_a),
                                      (nodes.on_b([]), nodes.dev_b, nodes.addr_b)):
                shown = subprocess.run([*prefix, "ip", "-o", "addr", "show", "dev", dev],
                                       capture_output=True, text=True, timeout=10, check=True)
                assert f"inet {addr}/24" in shown.stdout
    assert not Path("/sys/class/net", first.dev_a).exists()
    assert not Path("/sys/class/net", second.dev_a).exists()


def test_ranks_with_different_weights_refuse_to_start(tmp_path):
    run = _torchrun(2, "full", str(tmp_path / "swap"), str(tmp_path / "out.pt"), "1", "4",
                    "--other-seed-on-rank", "1")
    assert run.returncode != 0
    assert "start from other weights than rank 0" in run.stderr
    assert not (tmp_path / "out.pt").exists()


def test_the_weights_check_is_the_same_on_any_thread_count():
    """Machines with other core counts run their ranks on other thread counts; the same
    weights must pass the start check on all of them (a float sum of a large tensor gets
    other last bits on 1 and 2 threads, which once stopped such a job at its first step),
    and a weight one float step away must not."""
    torch.manual_seed(0)
    weights = [("w", torch.nn.Parameter(torch.randn(2048, 2048))),
               ("b", torch.nn.Parameter(torch.tensor(0.5)))]
    saved = torch.get_num_threads()
    try:
        prints = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            prints.append(weights_fingerprint(weights))
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(p, prints[0]) for p in prints)
    nudged = weights[0][1].detach().clone()
    nudged[7, 9] = torch.nextafter(nudged[7, 9], torch.tensor(float("inf")))
    other = weights_fingerprint([("w", torch.nn.Parameter(nudged)), weights[1]])
    assert not torch.equal(other, prints[0])
    assert torch.equal(other[1:], prints[0][1:])  # the other parameter's hash and the count


def test_a_rank_without_rows_adds_nothing():
    batch = make_batch(0, batch=3)
    shares = [batch_share(batch, r, 4) for r in range(4)]
    assert [s["input_ids"].shape[0] for s in shares] == [1, 1, 1, 1]
    assert torch.equal(shares[2]["input_ids"], batch["input_ids"][2:3])
    assert (shares[3]["labels"] == -100).all()  # joins the reductions with zero gradients
    halves = [batch_share(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h["labels"] for h in halves]), batch["labels"])
