"""cupyep.lab.balance_sim_tables on the committed simulation (CPU)."""
from pathlib import Path

from cupyep.lab import balance_sim_tables

SIM = Path(__file__).resolve().parents[1] / "results" / "balance_sim"


def test_the_simulation_readme_tables_are_what_their_command_prints():
    """Every table in results/balance_sim/README.md's tables is python -m cupyep.lab.balance_sim_tables's output
    on sim.jsonl, each part verbatim."""
    readme = (SIM / "README.md").read_text()
    parts = balance_sim_tables.markdown(SIM / "sim.jsonl").split("\n\n")
    assert len(parts) >= 4
    for part in parts:
        assert part in readme, part[:200]


def test_a_file_without_simulator_records_is_refused(tmp_path):
    empty = tmp_path / "x.jsonl"
    empty.write_text('{"kind": "other"}\n')
    assert balance_sim_tables.main([str(empty)]) == 2
    assert balance_sim_tables.main([str(tmp_path / "missing.jsonl")]) == 2
