"""The compiled parts of localkv: the compact blocks' decoder (``storage/_planes.c``),
llama.cpp's log filter (``localkv/model/_quietlog.c``), the vocabulary scan
(``localkv/model/_vocab.c``) and the V transposition of a restore
(``localkv/kv/_columns.c``).

Everything else is configured in pyproject.toml. The extensions are optional:
where one cannot be built, ``localkv.storage.formats.q6`` decodes with numpy,
``localkv.model.native`` hands llama.cpp's every log line to Python and
``localkv.prompt.markup`` asks for each token's attributes through ctypes and
``localkv.kv.columns`` transposes with numpy.
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
        ),
        Extension(
            "localkv.model._quietlog",
            ["localkv/model/_quietlog.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O2"],
            optional=True,
        ),
        Extension(
            "localkv.model._vocab",
            ["localkv/model/_vocab.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O2"],
            optional=True,
        ),
        Extension(
            "localkv.kv._columns",
            ["localkv/kv/_columns.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
            optional=True,
        ),
    ]
)
