"""Every process of a `jax.distributed` job runs the same plan (`_share`): two CPU processes on
this machine, the batch sharded over both (tests/distributed_job.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import tier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _job(tmp_path, tune: bool, via: str) -> list[dict]:
    port = str(_free_port())
    env = {**os.environ, "SMARTREMAT_DISK_CACHE": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed_job", str(p), port, str(int(tune)),
                               str(tmp_path / f"{p}.json"), via], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for p in (0, 1)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # a process waiting on its peer ignores SIGTERM (JAX's preemption notifier catches it)
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp_path / f"{p}.json").read_text()) for p in (0, 1)]


# `make test` (CI) runs "tune" (the store, timed) and "public-broadcast" (not timed): together
# they cover what "default" checks (about a minute of two processes each).
@pytest.mark.parametrize("tune, via", [pytest.param(*v, id=i) for i, v in tier(
    [("default", (False, "store")), ("tune", (True, "store")), ("public-broadcast", (False, "broadcast"))],
    ci=[("tune", (True, "store")), ("public-broadcast", (False, "broadcast"))])])
def test_two_processes_plan_once_and_run_the_same_plan(tmp_path, tune, via):
    first, second = _job(tmp_path, tune, via)
    assert (first["made"], second["made"]) == (1, 0)  # process 0 plans, process 1 only reads its plan
    assert first["runs"] == second["runs"]
    assert any(o != "none" for run in first["runs"] for _, o in run)  # the budget needs remat
    assert second["compiles"] == 0 and "planned by process 0" in second["notes"][-1]
    assert first["timed"] == second["timed"] and (first["timed"] > 0) == tune  # timed by both, together
    for out in (first, second):
        assert out["temp"] <= out["budget_mb"] * 2**20 < out["no_remat_temp"]  # per device, by the compiler
        assert out["loss"] == pytest.approx(out["want_loss"], rel=1e-6)
        assert out["max_rel_param"] <= 1e-6


def test_an_infeasible_budget_raises_process_0s_error_in_both(tmp_path):
    first, second = _job(tmp_path, False, "infeasible")
    assert (first["made"], second["made"]) == (1, 0)
    assert first["error"] == second["error"] and "Raise `budget_mb` to at least" in first["error"]
