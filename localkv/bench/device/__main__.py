"""``python -m localkv.bench.device``: the device comparison's driver (``run``)."""

import sys

from localkv.bench.device.run import main

if __name__ == "__main__":
    sys.exit(main())
