"""The soak's host side (experiments/soak.py): which tallies it keeps and
how its command line names routes and modes."""
import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", REPO / "experiments" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_normal_mode_runs_on_every_route_and_low_latency_once(soak):
    keys = soak.soak_keys(["normal", "micro_batches", "ll"], ["default", "direct"])
    assert keys == ["normal@queue", "normal@direct", "micro_batches@queue", "micro_batches@direct", "ll"]
    across = soak.soak_keys(["backward", "ll_hook"], ["default", "direct"], num_nodes=2)
    assert across == ["backward@two_hop", "backward@direct", "ll_hook"]
    assert soak.soak_keys(["worst"], ["direct"]) == ["worst@direct"]


def test_the_default_soak_covers_the_schedules_of_real_training(soak):
    assert {"micro_batches", "backward"} <= set(soak.MODES) and soak.ROUTES == ("default", "direct")


@pytest.mark.parametrize("text,ok", [("default,direct", True), ("direct", True), ("queue", False), ("", False)])
def test_routes_argument(soak, text, ok):
    if ok:
        assert soak._routes(text) == text.split(",")
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            soak._routes(text)
