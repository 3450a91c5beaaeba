"""The lab: what measures, sweeps and explains the library, apart from it.

- ``bench``: the main job (``python -m cupyep.lab.bench``), the copy
  roofline, timing boundaries, the per-mode measurements, multi-run tables,
  promoting a run into ``results/``;
- ``experiments``: sweeps over grids of knobs, the study registry, resumable
  JSONL records (``python -m cupyep.lab.experiments``);
- ``plotting``: figures of records (``python -m cupyep.lab.plotting``);
- ``advisor``: which mode and transport for a shape
  (``python -m cupyep.lab.advisor``);
- ``metrics``: the in-kernel metrics reduced for sweep records.

Nothing in the library (``cupyep`` outside ``cupyep.lab``) imports it, so
``import cupyep`` loads neither matplotlib nor tqdm.
"""
