"""``python -m localkv.bench.peer``: localkv beside llama-server (``run``)."""

import sys

from localkv.bench.peer.run import main

if __name__ == "__main__":
    sys.exit(main())
