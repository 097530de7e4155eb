"""The one compiled part of localkv: the compact blocks' decoder (``storage/_planes.c``).

Everything else is configured in pyproject.toml. The extension is optional:
where it cannot be built, ``localkv.storage.formats.q6`` decodes with numpy.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "localkv.storage._planes",
            ["storage/_planes.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)
