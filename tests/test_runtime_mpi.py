"""cupyep.init on CPU, under real MPI: 4 ranks started by cupyep.launcher.launch run
the scripts tests/mpi_scripts/runtime_*.py. Each script records named checks
on every rank and exits 0 only when every check holds on every rank; rank 0
prints ``CHECK <name> PASS|FAIL <why>`` lines, ``EXTRA <json>`` (every
rank's Group fields) and a marker line ``<MARKER> OK``."""

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "mpi_scripts"


def _env():
    env = dict(os.environ)
    for name in ("CUPYEP_RANKS_PER_NODE", "CUPYEP_LAUNCHED", "CUDA_VISIBLE_DEVICES",
                 "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO)
    return env


class Run:
    def __init__(self, script, launcher_args=()):
        cmd = [sys.executable, "-m", "cupyep.launcher.launch", "-n", "4", *launcher_args, "--timeout", "60",
               str(SCRIPTS / script)]
        self.proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
        self.checks, self.extra = {}, None
        for line in self.proc.stdout.splitlines():
            if line.startswith("CHECK "):
                _, name, status, *why = line.split(" ", 3)
                self.checks[name] = (status, why[0] if why else "")
            elif line.startswith("EXTRA "):
                self.extra = json.loads(line[len("EXTRA "):])

    @property
    def log(self):
        return f"exit {self.proc.returncode}\nstdout:\n{self.proc.stdout}\nstderr:\n{self.proc.stderr}"

    def assert_checks(self, *prefixes):
        """Every check whose name starts with one of ``prefixes`` ran and passed."""
        names = [n for n in self.checks if n.startswith(prefixes)]
        assert names, f"no check named {prefixes} in the output\n{self.log}"
        failed = {n: self.checks[n][1] for n in names if self.checks[n][0] != "PASS"}
        assert not failed, failed

    def groups(self, key):
        assert self.extra is not None and key in self.extra, self.log
        groups = self.extra[key]
        assert len(groups) == 4
        return groups


@lru_cache(maxsize=None)
def launch(script, *launcher_args):
    return Run(script, launcher_args)


# ---------------------------------------------------------------- topology ---

def test_topology_script_passes_on_every_rank():
    run = launch("runtime_topology.py")
    assert run.proc.returncode == 0, run.log
    assert "RUNTIME_TOPOLOGY OK" in run.proc.stdout.splitlines(), run.log
    assert run.checks and all(s == "PASS" for s, _ in run.checks.values()), run.log


def test_real_host_is_one_node_of_four():
    run = launch("runtime_topology.py")
    run.assert_checks("host.")
    groups = run.groups("host")
    assert [g["rank"] for g in groups] == [0, 1, 2, 3]
    assert [g["local_rank"] for g in groups] == [0, 1, 2, 3]
    assert {g["world_size"] for g in groups} == {4}
    assert {g["local_size"] for g in groups} == {4}
    assert {g["node"] for g in groups} == {0}
    assert {g["num_nodes"] for g in groups} == {1}
    assert all(g["node_ranks"] == [0, 1, 2, 3] for g in groups)


def test_ranks_per_node_2_emulates_two_nodes():
    run = launch("runtime_topology.py")
    run.assert_checks("rpn2.")
    groups = run.groups("rpn2")
    assert [g["local_rank"] for g in groups] == [0, 1, 0, 1]
    assert [g["node"] for g in groups] == [0, 0, 1, 1]
    assert {g["num_nodes"] for g in groups} == {2}
    assert {g["local_size"] for g in groups} == {2}
    assert [g["node_ranks"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_no_gpu_group():
    run = launch("runtime_topology.py")
    run.assert_checks("host.device_id_none", "host.has_gpu_false", "host.num_devices_0",
                      "host.shares_gpu_false", "rpn2.device_id_none", "rpn2.has_gpu_false")
    for g in run.groups("host") + run.groups("rpn2"):
        assert g["device_id"] is None and g["has_gpu"] is False and g["num_devices"] == 0
        assert g["shares_gpu"] is False and g["ranks_per_gpu"] == 0


def test_require_gpu_raises_runtime_error():
    launch("runtime_topology.py").assert_checks("host.require_gpu", "rpn2.require_gpu",
                                                "host.error_slot_needs_gpu", "host.check_errors_noop")


def test_timeout_s_kept_as_float():
    run = launch("runtime_topology.py")
    run.assert_checks("default_timeout_s", "timeout_s_float", "context_manager_returns_group")
    assert {g["timeout_s"] for g in run.groups("host")} == {100.0}


# ------------------------------------------------- launcher --ranks-per-node ---

def test_launcher_ranks_per_node_reaches_init():
    run = launch("runtime_env.py", "--ranks-per-node", "2")
    assert run.proc.returncode == 0, run.log
    assert "RUNTIME_ENV OK" in run.proc.stdout.splitlines(), run.log
    run.assert_checks("env_ranks_per_node", "env.")
    groups = run.groups("env")
    assert [g["local_rank"] for g in groups] == [0, 1, 0, 1]
    assert [g["node"] for g in groups] == [0, 0, 1, 1]
    assert [g["node_ranks"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert {g["num_nodes"] for g in groups} == {2}


def test_explicit_ranks_per_node_overrides_launcher():
    run = launch("runtime_env.py", "--ranks-per-node", "2")
    run.assert_checks("explicit4.", "explicit1.")
    groups = run.groups("explicit4")
    assert [g["local_rank"] for g in groups] == [0, 1, 2, 3]
    assert {g["num_nodes"] for g in groups} == {1}


# ------------------------------------------------------ errors, sub-comms ---

@pytest.mark.parametrize("check", ["ranks_per_node_3", "ranks_per_node_0", "ranks_per_node_-2",
                                   "ranks_per_node_8", "pairs_rpn4"])
def test_ranks_per_node_not_dividing_raises_value_error(check):
    launch("runtime_errors.py").assert_checks(check)


@pytest.mark.parametrize("check", ["comm_int", "comm_str", "comm_group_not_comm"])
def test_non_communicator_raises_type_error(check):
    launch("runtime_errors.py").assert_checks(check)


def test_comm_null_raises_value_error():
    launch("runtime_errors.py").assert_checks("comm_null")


def test_excluded_split_raises_value_error():
    launch("runtime_errors.py").assert_checks("comm_split_undefined")


@pytest.mark.parametrize("check", ["timeout_s_0", "timeout_s_-1.0", "timeout_s_nan", "pairs_timeout_0"])
def test_non_positive_timeout_raises_value_error(check):
    launch("runtime_errors.py").assert_checks(check)


def test_init_still_works_after_errors():
    launch("runtime_errors.py").assert_checks("world_after_errors.")


def test_sub_communicator_of_two_ranks():
    run = launch("runtime_errors.py")
    run.assert_checks("pairs.", "pairs_rpn1.")
    groups = run.groups("pairs")
    assert [g["rank"] for g in groups] == [0, 1, 0, 1]
    assert {g["world_size"] for g in groups} == {2}
    assert {g["num_nodes"] for g in groups} == {1}
    assert all(g["node_ranks"] == [0, 1] for g in groups)


def test_strided_reversed_sub_communicator():
    run = launch("runtime_errors.py")
    run.assert_checks("strided.")
    # Split(color=rank % 2, key=-rank): world ranks 2,3 come first.
    assert [g["rank"] for g in run.groups("strided")] == [1, 1, 0, 0]


def test_errors_script_passes_on_every_rank():
    run = launch("runtime_errors.py")
    assert run.proc.returncode == 0, run.log
    assert "RUNTIME_ERRORS OK" in run.proc.stdout.splitlines(), run.log


@pytest.mark.parametrize("check", ["stacked_in_rank_order", "second_exchange", "missing_rank_raises",
                                   "missing_rank_bounded", "exchange_after_timeout", "agree_same_passes",
                                   "agree_differing_raises_everywhere", "agree_names_first_field_and_values",
                                   "exchange_after_disagreement", "peer_arrays_addresses", "peer_arrays_mapped_once",
                                   "peer_arrays_empty_rank", "peer_arrays_cannot_everywhere"])
def test_bounded_exchange(check):
    launch("runtime_exchange.py").assert_checks(check)
