"""Print a TCP port that is free on 127.0.0.1 right now."""

import socket

with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1])
