"""Process entry point of one [`WorldPool`][comm_core.testing.WorldPool] rank."""

import sys
from multiprocessing.connection import Connection

from .pool import _worker_main

if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])))
