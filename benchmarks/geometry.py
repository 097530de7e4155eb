"""The cache at real model geometry: ``python benchmarks/geometry.py --out DIR``.

See ``localkv.bench.geometry`` and docs/performance/geometry.md.
"""

import sys

from localkv.bench.geometry.run import main

if __name__ == "__main__":
    sys.exit(main())
