"""CI kernel compile check: ``python -m cupyep.jit --check`` compiles every
registered kernel specialisation for sm_90 with nvcc (no GPU needed). Needs
the CUDA toolkit; without nvcc this test fails (it is not skipped)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupyep import jit


REPO = Path(__file__).resolve().parents[1]


def _find_nvcc():
    # The same places cupyep.jit.compile_offline looks.
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def test_jit_check_compiles_every_spec():
    if _find_nvcc() is None:
        pytest.fail("nvcc not found on PATH nor at /usr/local/cuda/bin/nvcc: the kernel compile check "
                    "(python -m cupyep.jit --check) needs the CUDA toolkit installed", pytrace=False)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "cupyep.jit", "--check"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    log = f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0, log
    specs = jit.all_specs()
    lines = res.stdout.splitlines()
    assert lines[0].split()[:2] == ["specialisation", "regs"], log
    rows = [line.split() for line in lines[1:] if line and not line.startswith("compiled ")]
    compiled = {row[0] for row in rows}
    missing = [s.name for s in specs if s.name not in compiled]
    assert not missing, f"specialisations missing from the --check table: {missing}\n{log}"
    assert compiled == {s.name for s in specs}, log
    # Every kernel of every spec got a ptxas report with registers.
    assert len(rows) == sum(len(s.kernels) for s in specs), log
    assert all(int(row[1]) > 0 for row in rows), log
    summary = [line for line in lines if line.startswith("compiled ")]
    assert summary and summary[0].startswith(f"compiled {len(specs)} specialisations ({len(rows)} kernels) "
                                             "for sm_90"), log


# Headers NVRTC (CuPy's RawModule) can open: CUDA's own and CuPy's bundled CCCL.
# A C/C++ standard header such as <cstdint> compiles with nvcc above but is
# missing under NVRTC, so it may only appear in a branch that NVRTC skips.
NVRTC_HEADERS = {"cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h", "cuda_runtime.h", "nvshmem.h", "nvshmemx.h"}


def _unguarded_includes(text: str) -> list[tuple[int, str]]:
    """(line, header) of every ``#include <...>`` outside NVRTC_HEADERS and not in
    an ``#ifdef __CUDACC_RTC__ ... #else`` / ``#ifndef __CUDACC_RTC__`` branch."""
    stack, bad = [], []          # per open #if: True while in a branch NVRTC skips
    for no, line in enumerate(text.splitlines(), 1):
        t = line.strip().replace("# ", "#")
        if t.startswith("#if"):
            skips = "ifndef __CUDACC_RTC__" in t or "!defined(__CUDACC_RTC__)" in t
            stack.append(True if skips else (False if "__CUDACC_RTC__" in t else None))
        elif t.startswith("#else") and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
        elif t.startswith("#endif") and stack:
            stack.pop()
        elif t.startswith("#include <"):
            header = t[len("#include <"):].split(">")[0]
            if header not in NVRTC_HEADERS and not header.startswith("cuda/") and not any(stack):
                bad.append((no, header))
    return bad


def _findings(check) -> dict:
    """{kernel source: check(its text)} for every source in cuda_src where the check finds something."""
    found = {}
    for path in sorted((REPO / "cuda_src").rglob("*.cu*")):
        bad = check(path.read_text())
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_every_kernel_source_compiles_under_nvrtc_headers():
    found = _findings(_unguarded_includes)
    assert not found, ("standard headers NVRTC cannot open (include common/types.cuh for fixed-width "
                       f"integers): {found}")


# Macros of the C library's headers (<math.h>, <float.h>, <limits.h>, <stdint.h>):
# nvcc's host headers define them, NVRTC does not.
LIBC_MACROS = ("INFINITY", "NAN", "HUGE_VAL", "HUGE_VALF", "FLT_MAX", "FLT_MIN", "DBL_MAX", "INT_MAX",
               "INT_MIN", "UINT_MAX", "M_PI", "SIZE_MAX", "CHAR_BIT", "INT32_MAX", "UINT32_MAX")


def _libc_macros(text: str) -> list[tuple[int, str]]:
    """(line, macro) of every LIBC_MACROS name used in code (comments stripped) and not #defined in ``text``."""
    code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    defined = set(re.findall(r"#\s*define\s+(\w+)", code))
    bad = []
    for no, line in enumerate(code.splitlines(), 1):
        line = line.split("//")[0]
        bad += [(no, m) for m in re.findall(r"\b[A-Z_0-9]+\b", line) if m in LIBC_MACROS and m not in defined]
    return bad


def test_no_kernel_source_uses_a_libc_macro():
    found = _findings(_libc_macros)
    assert not found, f"C library macros NVRTC does not define (write the value, e.g. __int_as_float(0x7f800000)): {found}"


def test_the_macro_check_sees_a_libc_macro():
    assert _libc_macros("float a = INFINITY;\n") == [(1, "INFINITY")]
    assert _libc_macros("int c; // or INT_MAX\n/* FLT_MAX */\n") == []
    assert _libc_macros("#define INT_MAX 0x7fffffff\nint c = INT_MAX;\n") == []


def test_the_include_check_sees_a_standard_header():
    assert _unguarded_includes("#include <cstdint>\n") == [(1, "cstdint")]
    assert _unguarded_includes("#include <cuda_bf16.h>\n#include <cuda/atomic>\n") == []
    guarded = "#ifdef __CUDACC_RTC__\ntypedef int int32_t;\n#else\n#include <cstdint>\n#endif\n"
    assert _unguarded_includes(guarded) == []
    assert _unguarded_includes("#ifndef __CUDACC_RTC__\n#include <cstdio>\n#endif\n") == []
    assert _unguarded_includes("#if FOO\n#else\n#include <cstdio>\n#endif\n") == [(3, "cstdio")]


class _NodeComm:
    """One rank's view of a node communicator whose local rank 0 sends ``failure``."""

    def __init__(self, failure):
        self.failure = failure

    def bcast(self, obj, root=0):
        return self.failure if obj is None else obj


class _Group:
    def __init__(self, local_rank, failure=None):
        self.local_rank, self.local_size, self.node_comm = local_rank, 2, _NodeComm(failure)


def _fake_device(monkeypatch):
    import cupy
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: type("D", (), {"id": 0})())
    monkeypatch.setattr(jit, "_modules", {})


def test_a_failed_compile_on_local_rank_0_raises_on_every_rank_of_the_node(monkeypatch):
    _fake_device(monkeypatch)
    spec = jit.all_specs()[0]

    def broken(s):
        raise SyntaxError("cannot open source file")
    monkeypatch.setattr(jit, "Module", broken)
    with pytest.raises(SyntaxError, match="cannot open"):
        jit.load(spec, _Group(0))
    with pytest.raises(RuntimeError, match=f"{spec.name}: local rank 0 of this node could not compile it.*"
                                           "cannot open source file"):
        jit.load(spec, _Group(1, failure="SyntaxError: cannot open source file"))
    monkeypatch.setattr(jit, "Module", lambda s: ("module", s.name))
    assert jit.load(spec, _Group(1)) == ("module", spec.name)
