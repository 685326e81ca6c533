"""Build of the C extensions, all without the GIL: kvstore/tiers/_pageio.c (the disk tier's
page I/O and checksums, and page copies between the memory tiers), kvstore/tiers/_kvcodec.c
(the KV tier codec: 8- and 4-bit pages), kvstore/_evict.c (the
device tier's eviction pass with host admission), kernels/_decode.c
(sparse decode attention on the CPU), kernels/_layerops.c (a decoder layer's small ops),
kernels/_select.c (page selection on the CPU), kernels/_qmatmul.c (matmuls by
4- and 8-bit weights) and kernels/_layer.c (a decode step's layer in one call, from the others);
everything else is in pyproject.toml."""
import os
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup


def openmp_flags() -> list[str]:
    """-fopenmp where the C compiler builds with it (then kernels/_pool.h runs its calls on
    torch's OpenMP team, the same libgomp.so.1), else none (its own threads)."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            ok = subprocess.run(cc + ["-fopenmp", src, "-o", os.path.join(tmp, "t")],
                                capture_output=True).returncode == 0
        except OSError:
            ok = False
    if not ok:
        print("setup.py: the C compiler has no OpenMP; kernels use threads of their own",
              file=sys.stderr)
    return ["-fopenmp"] if ok else []


OPENMP = openmp_flags()

setup(ext_modules=[Extension("kvstore.tiers._pageio", ["kvstore/tiers/_pageio.c"],
                             depends=["kvstore/tiers/_pageio_ring.h"],
                             extra_compile_args=["-O3", "-Wall"]),
                   Extension("kvstore.tiers._kvcodec", ["kvstore/tiers/_kvcodec.c"],
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv"]),
                   Extension("kvstore._evict", ["kvstore/_evict.c"],
                             extra_compile_args=["-O3", "-Wall"]),
                   # NOTE: Python's CFLAGS carry -fwrapv, which halves the speed of this
                   # kernel's vectorized loops (measured 2.5 against 1.3 ms per call)
                   Extension("kernels._decode", ["kernels/_decode.c"],
                             depends=["kernels/_rows.h", "kernels/_attend_rows.h",
                                      "kernels/_pool.h", "kernels/_decode_selected.h",
                                      "kernels/_api.h"],
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv", "-pthread"]
                             + OPENMP,
                             extra_link_args=["-pthread"] + OPENMP),
                   Extension("kernels._layerops", ["kernels/_layerops.c"],
                             depends=["kernels/_rows.h", "kernels/_api.h"],
                             # NOTE: no a*b+c fused into one rounding: torch's ops round each
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv",
                                                 "-ffp-contract=off"]),
                   Extension("kernels._qmatmul", ["kernels/_qmatmul.c"],
                             depends=["kernels/_pool.h", "kernels/_qmatmul_tiles.h",
                                      "kernels/_qmatmul_dequant.h", "kernels/_api.h"],
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv", "-pthread"]
                             + OPENMP,
                             extra_link_args=["-pthread"] + OPENMP),
                   Extension("kernels._layer", ["kernels/_layer.c"],
                             depends=["kernels/_api.h"],
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv"]),
                   Extension("kernels._select", ["kernels/_select.c"],
                             depends=["kernels/_rows.h", "kernels/_select_score.h",
                                      "kernels/_select_top.h", "kernels/_api.h"],
                             extra_compile_args=["-O3", "-Wall", "-fno-wrapv"])])
