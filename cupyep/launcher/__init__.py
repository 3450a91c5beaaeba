"""Running ranks: the launcher (``python -m cupyep.launcher -n 8 app.py``:
mpiexec, CUDA MPS when ranks share a GPU, a dead rank named with its call),
the MPS daemon's handling, the per-rank call records, and the GPU test
runner (``python -m cupyep.launcher.gpu_tests``)."""
