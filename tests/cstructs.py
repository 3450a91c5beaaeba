"""C structs of cuda_src/ parsed from the source, and the check that a NumPy
struct dtype mirrors one (field names, order, offsets, types, size and
alignment by the C rules for x86-64/CUDA). Shared by the CPU tests."""
import re

import numpy as np

from cupyep import jit


C_SCALARS = {"int": (4, np.int32), "int32_t": (4, np.int32), "int64_t": (8, np.int64),
             "uint64_t": (8, np.uint64), "float": (4, np.float32)}

# Source folders whose structs live in their own namespace and may reuse names
# of other folders: keyed as "folder::Name".
NAMESPACED = ("low_latency",)


def strip_comments(text: str) -> str:
    """C/C++ source without its comments."""
    return re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)


def c_structs():
    """Every ``struct Name { ... };`` of cuda_src: name -> [(field, type, is_pointer)]; a fixed
    array field ``name[N]`` (N a literal) gives its elements as fields name0 .. name{N-1}."""
    structs = {}
    for path in sorted(jit.CUDA_SRC.rglob("*")):
        if path.suffix not in (".cu", ".cuh"):
            continue
        prefix = f"{path.parent.name}::" if path.parent.name in NAMESPACED else ""
        for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^{}]*)\};", strip_comments(path.read_text())):
            fields = []
            for decl in m.group(2).split(";"):
                parts = [p.strip() for p in decl.strip().split(",")]
                if not parts[0]:
                    continue
                first = re.match(r"^(.*?)(\w+(?:\[\d+\])?)$", parts[0])
                ctype = first.group(1).strip()
                names = [first.group(2)] + parts[1:]
                base = re.sub(r"\bconst\b|\*", " ", ctype).split()
                assert len(base) == 1, f"{path}: cannot parse {decl!r}"
                for name in names:
                    array = re.fullmatch(r"(\w+)\[(\d+)\]", name)  # a fixed array: its elements, name0, name1, ...
                    elements = [f"{array.group(1)}{i}" for i in range(int(array.group(2)))] if array else [name]
                    for element in elements:
                        assert re.fullmatch(r"\w+", element), f"{path}: cannot parse {decl!r}"
                        fields.append((element, base[0], "*" in ctype))
            name = prefix + m.group(1)
            assert name not in structs, f"struct {name} defined twice"
            structs[name] = fields
    return structs


def resolve(ctype, within, structs):
    """A field's struct type, looked up first in the namespace of the struct holding it."""
    ns = within.rpartition("::")[0]
    return f"{ns}::{ctype}" if ns and f"{ns}::{ctype}" in structs else ctype


def c_layout(name, structs):
    """(size, align, [(field, offset, type, is_pointer)]) by the C rules for x86-64/CUDA."""
    off, align, out = 0, 1, []
    for field, ctype, is_ptr in structs[name]:
        if is_ptr:
            size, a = 8, 8
        elif ctype in C_SCALARS:
            size = a = C_SCALARS[ctype][0]
        else:
            size, a, _ = c_layout(resolve(ctype, name, structs), structs)
        off = (off + a - 1) // a * a
        out.append((field, off, ctype, is_ptr))
        off += size
        align = max(align, a)
    return (off + align - 1) // align * align, align, out


def assert_mirrors(dtype, cname, structs, path=""):
    """AssertionError unless ``dtype`` lays out exactly like struct ``cname``."""
    size, align, fields = c_layout(cname, structs)
    where = path or cname
    assert dtype.names == tuple(f for f, *_ in fields), f"{where}: field names/order differ from struct {cname}"
    for field, offset, ctype, is_ptr in fields:
        ftype, foff = dtype.fields[field][:2]
        assert foff == offset, f"{where}.{field}: offset {foff}, C has {offset}"
        if is_ptr:
            assert ftype == np.uint64, f"{where}.{field}: pointer mirrored as {ftype}"
        elif ctype in C_SCALARS:
            assert ftype == C_SCALARS[ctype][1], f"{where}.{field}: {ctype} mirrored as {ftype}"
        else:
            assert ftype.names, f"{where}.{field}: struct {ctype} mirrored as {ftype}"
            assert_mirrors(ftype, resolve(ctype, cname, structs), structs, f"{where}.{field}")
    assert dtype.itemsize == size, f"{where}: itemsize {dtype.itemsize}, sizeof({cname}) = {size}"
    assert dtype.alignment == align, f"{where}: alignment {dtype.alignment}, alignof({cname}) = {align}"
