"""cupyep.lab.balance_table on the committed balance study (CPU)."""
from pathlib import Path

from cupyep.lab import balance_table


def test_the_balance_study_readme_table_is_what_its_command_prints():
    """results/balance_study/README.md shows python -m cupyep.lab.balance_table's output on its records."""
    study = Path(__file__).resolve().parents[1] / "results" / "balance_study"
    names = ["study_8ranks_hot05.jsonl", "study_8ranks_hot08_1.jsonl", "study_8ranks_hot08_2.jsonl",
             "study_8ranks_zipf.jsonl", "study_8ranks_drift.jsonl"]
    table = balance_table.markdown([study / n for n in names])
    assert table in (study / "README.md").read_text()
    assert balance_table.main([str(study / "no_such.jsonl")]) == 2
