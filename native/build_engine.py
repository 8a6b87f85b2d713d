"""cffi build script for ``swarmfs._native`` (the io_uring engine and data kernels).

Used by setup.py (``cffi_modules``) so that ``pip install -e .`` compiles it.
Links the system liburing (Debian/Ubuntu: ``liburing-dev``).  liburing's
``static inline`` helpers (``io_uring_prep_read`` and friends) are called from
our own C code, so the plain library suffices; where ``liburing-ffi`` exists
(liburing >= 2.4) it is preferred, as it exports those helpers as symbols.
XXH3 comes from the system xxHash headers (``libxxhash-dev``), inlined.
"""

import os
import shutil
import subprocess

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# the engine (engine.c, rings.c) and the data kernels, one file per job
# (kernels_int.h lists them)
SOURCES = ("engine.c", "rings.c", "data.c", "scoring.c", "index_i8.c", "select.c",
           "planner.c", "gather.c")
HEADERS = ("engine.h", "engine_int.h", "kernels_int.h")


def _header_cdefs() -> str:
    # cffi's cdef cannot read preprocessor guards or includes: keep the body.
    lines = []
    with open(os.path.join(HERE, "engine.h")) as f:
        for line in f:
            if line.startswith("#include") or line.startswith("#ifndef") or \
               line.startswith("#endif") or line.startswith("#define SWARMFS_ENGINE_H"):
                continue
            lines.append(line)
    return "".join(lines)


def _uring_lib() -> str:
    pkg = shutil.which("pkg-config")
    if pkg:
        for name in ("liburing-ffi", "liburing"):
            if subprocess.run([pkg, "--exists", name]).returncode == 0:
                return "uring-ffi" if name == "liburing-ffi" else "uring"
    return "uring"


ffibuilder = FFI()
ffibuilder.cdef(_header_cdefs())
ffibuilder.set_source(
    "swarmfs._native",
    '#include "engine.h"',
    sources=[os.path.relpath(os.path.join(HERE, f)) for f in SOURCES],
    depends=[os.path.relpath(os.path.join(HERE, f)) for f in HEADERS],
    include_dirs=[os.path.relpath(HERE)],
    libraries=[_uring_lib(), "pthread", "m"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
