"""Host side of NVSHMEM (cupyep.nvshmem) and the symbol lookup that
path-loaded kernel modules use (cupyep.jit): the library's location and
version, the versions check, the device-side build (nvcc -rdc + nvlink
against libnvshmem_device.a) and its disk cache, the runtime's error when
the Python binding is missing. No GPU needed."""
import importlib.util
import os
import shutil
import sys

import pytest

from cupyep import jit

from cupyep import nvshmem as NV



def test_mangled_prefix_of_name_expressions():
    assert jit.mangled_prefix("cupyep::shmem::put_signal<256>") == "_ZN6cupyep5shmem10put_signalILi256EEE"
    assert jit.mangled_prefix("cupyep::normal::direct_dispatch<8, 512>") == \
        "_ZN6cupyep6normal15direct_dispatchILi8ELi512EEE"
    assert jit.mangled_prefix("cupyep::normal::notify_kernel") == "_ZN6cupyep6normal13notify_kernelE"
    assert jit.mangled_prefix("cupyep::k<true, -3>") == "_ZN6cupyep1kILb1ELin3EEE"
    with pytest.raises(ValueError, match="template argument"):
        jit.mangled_prefix("cupyep::k<float>")


def test_kernel_symbols_pick_each_expression_and_refuse_ambiguity():
    spec = jit.KernelSpec("t", "x.cu", ("cupyep::a::k<8>", "cupyep::a::k<16>"))
    report = ("ptxas info    : Compiling entry function '_ZN6cupyep1a1kILi16EEEvNS0_4ArgsE' for 'sm_90'\n"
              "ptxas info    : Compiling entry function '_ZN6cupyep1a1kILi8EEEvNS0_4ArgsE' for 'sm_90'\n")
    assert jit.kernel_symbols(spec, report) == {"cupyep::a::k<8>": "_ZN6cupyep1a1kILi8EEEvNS0_4ArgsE",
                                               "cupyep::a::k<16>": "_ZN6cupyep1a1kILi16EEEvNS0_4ArgsE"}
    with pytest.raises(RuntimeError, match="no single symbol"):
        jit.kernel_symbols(jit.KernelSpec("t", "x.cu", ("cupyep::a::k<32>",)), report)


def test_versions_must_match():
    NV.check_versions((3, 4, 5), (3, 4, 5))
    with pytest.raises(NV.NvshmemUnavailable, match="3.4.4 does not match the device library 3.4.5"):
        NV.check_versions((3, 4, 4), (3, 4, 5))


def test_a_folder_without_nvshmem_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    NV.root.cache_clear()
    try:
        with pytest.raises(NV.NvshmemUnavailable, match="no NVSHMEM headers"):
            NV.root()
    finally:
        NV.root.cache_clear()


needs_library = pytest.mark.skipif(importlib.util.find_spec("nvidia.nvshmem") is None,
                                   reason="the nvidia-nvshmem-cu13 wheel is not installed")
needs_nvcc = pytest.mark.skipif(not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")),
                                reason="no nvcc")


@needs_library
def test_library_version_is_read_from_its_headers():
    major, minor, patch = NV.version()
    assert (major, minor) >= (3, 0) and (NV.root() / "lib" / "libnvshmem_device.a").exists()
    assert any(o.endswith("/include") for o in NV.include_options())


@needs_library
@needs_nvcc
def test_device_build_links_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYEP_CACHE_DIR", str(tmp_path))
    spec = NV.put_signal_spec()
    cubin, symbols = NV.build(spec)
    assert cubin.exists() and cubin.stat().st_size > 100_000  # NVSHMEM's device library is linked in
    assert symbols == {"cupyep::shmem::put_signal<256>": symbols["cupyep::shmem::put_signal<256>"]}
    assert symbols["cupyep::shmem::put_signal<256>"].startswith("_ZN6cupyep5shmem10put_signalILi256EE")
    mtime = cubin.stat().st_mtime_ns
    again, _ = NV.build(spec)
    assert again == cubin and again.stat().st_mtime_ns == mtime  # from the cache, not rebuilt
    other = NV.put_signal_spec(128)
    assert NV.cache_key(other, "sm_90") != NV.cache_key(spec, "sm_90") != NV.cache_key(spec, "sm_100")


def test_runtime_without_the_binding_says_how_to_install(monkeypatch):
    # as if nvshmem4py were not installed (None in sys.modules: its import fails), whether or not it is
    for name in [m for m in sys.modules if m == "nvshmem" or m.startswith("nvshmem.")] + ["nvshmem", "nvshmem.core"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(NV.NvshmemUnavailable, match=r'pip install -e "\.\[nvshmem\]"'):
        NV.init(object())


def test_the_heap_check_sums_the_ranks_of_each_gpu():
    """heap_shortfall: the ranks sharing a GPU ask together; each GPU is held to
    the least free memory its ranks saw, less the margin."""
    G = 1 << 30
    fits = [("a", 0, 10 * G, 80 * G), ("a", 0, 10 * G, 79 * G), ("a", 1, 60 * G, 80 * G)]
    assert NV.heap_shortfall(fits) == []
    short = [("a", 0, 40 * G, 80 * G), ("a", 0, 40 * G, 80 * G), ("b", 0, 40 * G, 80 * G)]
    assert NV.heap_shortfall(short) == [("a", 0, 80 * G, 80 * G)]
    assert NV.heap_shortfall([("a", 0, 79 * G, 80 * G)]) == []
    assert NV.heap_shortfall([("a", 0, 79 * G + 1, 80 * G)]) == [("a", 0, 79 * G + 1, 80 * G)]
    assert NV.heap_shortfall([("a", 0, 79 * G + 1, 80 * G)], margin=0) == []
