"""Master address and port: environment, Slurm node lists, job-id ports."""

from __future__ import annotations

import pytest

from kfac_hpc.runtime.launch import LaunchError, LaunchInfo
from kfac_hpc.runtime.rendezvous import expand_nodelist, resolve_rendezvous, slurm_port


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-4]", ["n1", "n2", "n3", "n4"]),
        ("gpu[08-11,15]", ["gpu08", "gpu09", "gpu10", "gpu11", "gpu15"]),
        ("a[1-2],login3,b[7]", ["a1", "a2", "login3", "b7"]),
        ("rack1-n[1-2]-ib", ["rack1-n1-ib", "rack1-n2-ib"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_slurm_port_in_range_and_distinct_for_neighbouring_jobs() -> None:
    ports = {slurm_port(job) for job in range(1000, 1400)}
    assert len(ports) == 400
    assert all(20000 <= p < 60000 for p in ports)
    assert slurm_port(5, 0) != slurm_port(5, 1)


def test_environment_wins() -> None:
    info = LaunchInfo(1, 4, 1, 4, "slurm")
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "SLURM_JOB_NODELIST": "n[1-4]"}
    rdv = resolve_rendezvous(info, env)
    assert (rdv.addr, rdv.port, rdv.source) == ("10.0.0.1", 29500, "env")


def test_slurm_first_host_and_job_port() -> None:
    info = LaunchInfo(0, 2, 0, 1, "slurm")
    env = {"SLURM_JOB_NODELIST": "localhost,n9", "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "2"}
    rdv = resolve_rendezvous(info, env)
    assert rdv.source == "slurm"
    assert rdv.addr == "127.0.0.1"
    assert rdv.port == slurm_port(1234, 2)


def test_single_process_uses_loopback() -> None:
    rdv = resolve_rendezvous(LaunchInfo(0, 1, 0, 1, "single"), {})
    assert rdv.addr == "127.0.0.1" and rdv.source == "local" and rdv.port > 0


def test_env_launch_without_master_is_refused() -> None:
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        resolve_rendezvous(LaunchInfo(0, 2, 0, 2, "env"), {})


def test_bad_port_is_refused() -> None:
    with pytest.raises(LaunchError, match="MASTER_PORT='abc'"):
        resolve_rendezvous(
            LaunchInfo(0, 2, 0, 2, "env"), {"MASTER_ADDR": "h", "MASTER_PORT": "abc"}
        )
