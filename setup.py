"""Build of the one C extension (kvstore/tiers/_pageio.c: the disk tier's page I/O and
checksums, and page copies between the memory tiers, without the GIL); everything else is in
pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstore.tiers._pageio", ["kvstore/tiers/_pageio.c"],
                             depends=["kvstore/tiers/_pageio_ring.h"],
                             extra_compile_args=["-O3", "-Wall"])])
