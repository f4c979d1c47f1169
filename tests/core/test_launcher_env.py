"""Reading launcher environments: torchrun, Slurm, MPI, and the Slurm node list."""

from __future__ import annotations

import pytest

from comm_core import LauncherError, infer_launcher, parse_slurm_nodelist, slurm_job_port
from comm_core.launcher import read_launch_env


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "none"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "pytorch"),
        ({"TORCHELASTIC_RUN_ID": "x"}, "pytorch"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "slurm"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),
        ({"MV2_COMM_WORLD_RANK": "0"}, "mpi"),
        ({"PMI_RANK": "1"}, "mpi"),
        # mpirun inside a batch script inherits SLURM_PROCID; mpirun's own variables win
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "3"}, "mpi"),
        # srun --mpi=pmi2 sets PMI_RANK as well; the Slurm step is the launcher
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "PMI_RANK": "1"}, "slurm"),
        # torchrun started by srun
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "3", "WORLD_SIZE": "8"}, "pytorch"),
    ],
)
def test_infer_launcher_from_environment(environ: dict[str, str], expected: str) -> None:
    assert infer_launcher(environ) == expected


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu-[01-03,7],cpu9", ["gpu-01", "gpu-02", "gpu-03", "gpu-7", "cpu9"]),
        ("a[1-2],b", ["a1", "a2", "b"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("host-a.example,host-b", ["host-a.example", "host-b"]),
        (" x[3] ", ["x3"]),
    ],
)
def test_parse_slurm_nodelist_expands_compressed_forms(nodelist: str, hosts: list[str]) -> None:
    assert parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "fragment"),
    [
        ("", "empty"),
        ("gpu-[01-03", "never closed"),
        ("gpu-01]", "unmatched"),
        ("gpu-[3-1]", "backwards"),
        ("gpu-[a-b]", "not a number"),
        ("a,,b", "empty host name"),
        ("scontrol: error: Invalid hostlist", "white space"),
    ],
)
def test_parse_slurm_nodelist_rejects_bad_lists(nodelist: str, fragment: str) -> None:
    with pytest.raises(LauncherError, match=fragment) as info:
        parse_slurm_nodelist(nodelist)
    assert "MASTER_ADDR" in str(info.value)  # says how to bypass


def test_slurm_job_port_spreads_jobs_below_ephemeral_range() -> None:
    assert slurm_job_port(0) == 15000
    assert slurm_job_port("123456") == 15000 + 123456 % 15000 == 18456
    assert slurm_job_port(29999) == 15000 + 14999
    assert slurm_job_port(1) != slurm_job_port(2)
    assert all(15000 <= slurm_job_port(j) < 30000 for j in range(0, 100000, 997))


SLURM = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "gpu-[01-02]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "777",
}


def test_slurm_environment_gives_ranks_master_and_job_port() -> None:
    launch = read_launch_env("slurm", environ=SLURM)
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 4, 1)
    assert launch.local_world_size == 2
    assert launch.master_addr == "gpu-01"
    assert launch.master_port == 15777
    assert launch.as_environ() == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu-01",
        "MASTER_PORT": "15777",
    }


def test_slurm_uneven_tasks_per_node() -> None:
    env = dict(SLURM, SLURM_TASKS_PER_NODE="3,1", SLURM_NODEID="1", SLURM_PROCID="3")
    env["SLURM_LOCALID"] = "0"
    assert read_launch_env("slurm", environ=env).local_world_size == 1


def test_slurm_explicit_master_addr_and_port_win() -> None:
    env = dict(SLURM, MASTER_ADDR="login7", MASTER_PORT="23456")
    launch = read_launch_env("slurm", environ=env)
    assert (launch.master_addr, launch.master_port) == ("login7", 23456)
    assert read_launch_env("slurm", environ=env, port=20001).master_port == 20001


def test_slurm_job_nodelist_is_used_when_nodelist_missing() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "cn[5-6]"
    assert read_launch_env("slurm", environ=env).master_addr == "cn5"


def test_slurm_without_job_id_uses_default_port() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    assert read_launch_env("slurm", environ=env).master_port == 29500


def test_slurm_unparseable_nodelist_is_a_clear_error_not_master_addr() -> None:
    env = dict(SLURM, SLURM_NODELIST="scontrol: error: host list is invalid")
    with pytest.raises(LauncherError, match="Cannot parse the Slurm node list"):
        read_launch_env("slurm", environ=env)


def test_slurm_missing_nodelist_is_a_clear_error() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    with pytest.raises(LauncherError, match="SLURM_NODELIST"):
        read_launch_env("slurm", environ=env)


@pytest.mark.parametrize(
    ("variables", "local_rank", "local_size"),
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            },
            1,
            4,
        ),
        (
            {
                "MV2_COMM_WORLD_RANK": "5",
                "MV2_COMM_WORLD_SIZE": "8",
                "MV2_COMM_WORLD_LOCAL_RANK": "2",
            },
            2,
            None,
        ),
        (
            {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"},
            3,
            4,
        ),
    ],
)
def test_mpi_variants_set_local_rank(
    variables: dict[str, str], local_rank: int, local_size: int | None
) -> None:
    env = dict(variables, MASTER_ADDR="n1", MASTER_PORT="29600")
    launch = read_launch_env("mpi", environ=env)
    assert (launch.rank, launch.world_size) == (5, 8)
    assert launch.local_rank == local_rank
    assert launch.as_environ()["LOCAL_RANK"] == str(local_rank)
    assert launch.local_world_size == local_size


def test_mpi_without_master_addr_says_how_to_set_it() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    }
    with pytest.raises(LauncherError, match="MASTER_ADDR") as info:
        read_launch_env("mpi", environ=env)
    assert "mpirun -x MASTER_ADDR" in str(info.value)
    # the port defaults to torch's customary one once the address is given
    assert read_launch_env("mpi", environ=dict(env, MASTER_ADDR="h")).master_port == 29500


def test_pytorch_environment_and_missing_variables() -> None:
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "29501",
        "GROUP_RANK": "1",
    }
    launch = read_launch_env("pytorch", environ=env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (
        2,
        4,
        0,
        2,
    )
    assert launch.node_key.endswith("#1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        partial = {k: v for k, v in env.items() if k != name}
        with pytest.raises(LauncherError, match=name):
            read_launch_env("pytorch", environ=partial)
    # without MASTER_* when the caller brings its own init_method
    no_master = {k: v for k, v in env.items() if not k.startswith("MASTER")}
    assert read_launch_env("pytorch", environ=no_master, need_master=False).master_addr is None


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"RANK": "two"}, "RANK must be an integer, got 'two'"),
        ({"RANK": "4"}, "rank 4 is outside 0..3"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "world size 0 is below 1"),
        ({"LOCAL_RANK": "2"}, "local rank 2 is outside 0..1"),
        ({"MASTER_PORT": "70000"}, "1-65535"),
    ],
)
def test_malformed_pytorch_environment(change: dict[str, str], fragment: str) -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    env.update(change)
    with pytest.raises(LauncherError, match=fragment):
        read_launch_env("pytorch", environ=env)


def test_unknown_launcher_lists_the_known_ones() -> None:
    with pytest.raises(LauncherError, match="expected one of pytorch, slurm, mpi"):
        read_launch_env("pbs", environ={})


def test_slurm_step_nodelist_and_step_id_pick_master_and_port() -> None:
    env = {
        "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "123456",
        "SLURM_NODELIST": "node[01-04]", "SLURM_STEP_NODELIST": "node[03-04]",
    }  # fmt: skip
    first = read_launch_env("slurm", environ=env)
    assert first.master_addr == "node03"  # the step runs on nodes 3 and 4, not on node01
    assert first.master_port == 15000 + 123456 % 15000
    second = read_launch_env("slurm", environ={**env, "SLURM_STEP_ID": "1"})
    assert second.master_port == 15000 + (123456 + 7919) % 15000 != first.master_port
    batch = read_launch_env("slurm", environ={**env, "SLURM_STEP_ID": "4294967294"})
    assert batch.master_port == first.master_port  # the batch step's id is not a step number
