"""The NCCL pre-flight's logic on the CPU, its device queries faked as parameters: accelerate's
rule for peer-to-peer access that does not work, the settings made before NCCL connects, the
versions compared across hosts, and the short all-reduce probe that names a stuck rank. The
store gather and the probe's all-reduce run for real over torch's store and gloo."""

from __future__ import annotations

import datetime
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as torch_dist

from imgtrainer.distributed.nccl_preflight import (
    NodeFacts,
    driver_version,
    p2p_unreliable,
    probe,
    run_preflight,
    store_gather,
    torch_probe,
    version_mismatch,
)
from imgtrainer.errors import RunFailed

RTX4090 = "NVIDIA GeForce RTX 4090"
A100 = "NVIDIA A100-SXM4-80GB"


def facts(rank: int, host: str, gpus=(A100, A100), driver="550.54.14", nccl="2.21.5"):
    return NodeFacts(rank, host, tuple(gpus), driver, nccl)


def test_peer_to_peer_is_unreliable_by_accelerates_rule():
    """Several GPUs, one an RTX 40 series card, a driver older than 550.40.07."""
    assert p2p_unreliable((RTX4090, RTX4090), "535.104.05")
    assert p2p_unreliable((RTX4090, A100), "550.40.06")
    assert p2p_unreliable((RTX4090, RTX4090), "")  # unknown driver: assume the worst
    assert not p2p_unreliable((RTX4090, RTX4090), "550.40.07")
    assert not p2p_unreliable((RTX4090, RTX4090), "555.42.02")
    assert not p2p_unreliable((RTX4090,), "535.104.05")  # one GPU: no peer to reach
    assert not p2p_unreliable((A100, A100), "470.57.02")
    assert not p2p_unreliable(("NVIDIA GeForce RTX 3090",) * 2, "535.104.05")  # not in its list


def fake_world(everyone: list[NodeFacts]):
    """A gather that returns ``everyone`` with the caller's own facts (and what it made) in its
    place, recording the call."""
    calls = []

    def gather(own: NodeFacts) -> list[NodeFacts]:
        calls.append(own)
        return [own if f.rank == own.rank else f for f in everyone]

    return gather, calls


def test_a_node_of_consumer_cards_disables_peer_to_peer_before_nccl_connects():
    """Rank 0's node (two RTX 4090s, an old driver) sets both settings, except one the user set
    already, before joining; the line says what was found and set, on which host."""
    everyone = [
        facts(0, "box-a", (RTX4090, RTX4090), "535.104.05"),
        facts(1, "box-a", (RTX4090, RTX4090), "535.104.05"),
        facts(2, "box-b", (RTX4090, RTX4090), "535.104.05"),
        facts(3, "box-b", (RTX4090, RTX4090), "535.104.05"),
    ]
    # Another rank's facts as it gathered them: it set only what its user had not.
    everyone[2] = replace(everyone[2], made=("NCCL_P2P_DISABLE=1",))
    gather, calls = fake_world(everyone)
    environ = {"NCCL_IB_DISABLE": "0"}  # the user's own choice stays
    seen_at_join = []
    result = run_preflight(
        everyone[0],
        gather,
        lambda: seen_at_join.append(dict(environ)),
        lambda seconds: 10.0,  # 1 + 2 + 3 + 4
        lambda: {0, 1, 2, 3},
        environ,
    )
    assert environ == {"NCCL_IB_DISABLE": "0", "NCCL_P2P_DISABLE": "1"}
    assert seen_at_join == [environ]  # set before the process group connected
    assert calls[0].made == ("NCCL_P2P_DISABLE=1",)
    assert result.warning == ""
    assert result.line.startswith(
        "NCCL pre-flight: 4 rank(s) on 2 host(s), NCCL 2.21.5, driver 535.104.05; "
        f"set NCCL_P2P_DISABLE=1 on box-a (2 x {RTX4090}, driver 535.104.05: peer-to-peer "
        "access that the driver reports does not work); set NCCL_P2P_DISABLE=1 on box-b"
    )
    assert result.line.endswith("all-reduce probe 0.00 s")


def test_a_healthy_job_sets_nothing_and_versions_that_differ_are_named():
    environ: dict[str, str] = {}
    everyone = [facts(0, "a"), facts(1, "b", nccl="2.20.3"), facts(2, "c", driver="535.104.05")]
    gather, _ = fake_world(everyone)
    result = run_preflight(everyone[0], gather, lambda: None, lambda s: 6.0, lambda: {0}, environ)
    assert environ == {}
    assert "nothing set" in result.line
    assert result.warning == (
        "NCCL 2.21.5 on a, c; NCCL 2.20.3 on b | driver 550.54.14 on a, b; driver 535.104.05 on c"
    )
    assert version_mismatch([facts(0, "a"), facts(1, "a"), facts(2, "b")]) == ""


def test_the_probe_names_the_rank_that_never_reached_it():
    everyone = [facts(r, "a" if r < 2 else "b") for r in range(4)]

    def hangs(seconds: float) -> float:
        raise TimeoutError(f"ran over {seconds} s")

    with pytest.raises(RunFailed) as stuck:
        probe(hangs, lambda: {0, 1, 3}, everyone, seconds=5)
    assert str(stuck.value) == (
        "the NCCL pre-flight's all-reduce did not finish in 5 s: rank 2 on b never reached it "
        "(stuck before its first collective); the others waited"
    )
    with pytest.raises(RunFailed, match="though all 4 ranks reached it: NCCL's transport"):
        probe(hangs, lambda: {0, 1, 2, 3}, everyone, seconds=5)
    with pytest.raises(RunFailed, match="returned 9 instead of 10: data is corrupted"):
        probe(lambda s: 9.0, lambda: set(), everyone)


def test_the_driver_version_is_read_from_the_kernel_module(tmp_path):
    version = tmp_path / "version"
    version.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Thu Feb 22 01:25:25 UTC 2024\n"
        "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
    )
    assert driver_version(version) == "550.54.14"
    assert driver_version(tmp_path / "absent") == ""


def test_the_gather_and_the_probe_over_torchs_store_and_a_process_group():
    """torch's own store and collective under the adapters (gloo, one process: the CPU's)."""
    store = torch_dist.HashStore()
    other = facts(1, "b", nccl="2.20.3")
    record = {"rank": 1, "host": "b", "gpus": [A100, A100], "driver": "550.54.14"}
    store.set("preflight/facts/1", json.dumps({**record, "nccl": "2.20.3", "made": []}))
    assert store_gather(store, 2)(facts(0, "a")) == [facts(0, "a"), other]
    with pytest.raises(RunFailed, match=r"waited 0.1 s for rank\(s\) 2, which never reached"):
        store_gather(store, 3, seconds=0.1)(facts(0, "a"))
    torch_dist.init_process_group(
        "gloo",
        store=torch_dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        all_reduce, arrived = torch_probe(store, torch.device("cpu"), 0, 2)
        assert arrived() == set()
        assert all_reduce(5.0) == 1.0
        assert arrived() == {0}
    finally:
        torch_dist.destroy_process_group()
