"""Inside an agent's jail: the endpoint on 127.0.0.1 of the jail's own network namespace.

    python -m tsync_mcore.sandbox.forward SOCKET PORT CWD COMMAND

listens on 127.0.0.1:PORT (the jail's loopback: nothing else is reachable from its network
namespace), forwards each connection to the Unix socket SOCKET (the endpoint's, bound into
the jail), and runs COMMAND (a shell command) beside it in CWD (the rollout's working
directory, where the jail shows it; else the jail's own), as the same user; it exits with
the command's status. The agent's OPENAI_BASE_URL names http://127.0.0.1:PORT/..., so an
agent written against the OpenAI API runs unchanged; its PATH is the jail's, then the
rollout's (TSYNC_HOST_PATH: a virtual environment's scripts).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading

PORT = 8000  # the jail's own network namespace: always free there
HOST_PATH = "TSYNC_HOST_PATH"  # the rollout's PATH: searched after the jail's own
CHUNK = 1 << 16


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _serve(listener: socket.socket, path: str) -> None:
    async def one(reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_unix_connection(path)
        except OSError:  # the endpoint is gone (the rollout is stopping)
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
        for w in (writer, up_w):
            w.close()

    server = await asyncio.start_server(one, sock=listener)
    async with server:
        await server.serve_forever()


def listen(port: int) -> socket.socket:
    """The listening socket, bound before the agent starts (its first request finds it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    return s


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not argv[1].isdigit():
        print("usage: python -m tsync_mcore.sandbox.forward SOCKET PORT CWD COMMAND",
              file=sys.stderr)
        return 2
    path, port, cwd, command = argv[0], int(argv[1]), argv[2], argv[3]
    try:
        os.chdir(cwd)
    except OSError:
        pass  # not visible in the jail: its own working directory
    try:
        listener = listen(port)
    except OSError as e:
        print(f"forward: cannot listen on 127.0.0.1:{port}: {e}", file=sys.stderr)
        return 125
    threading.Thread(target=asyncio.run, args=(_serve(listener, path),), daemon=True).start()
    env = dict(os.environ)
    host_path = env.pop(HOST_PATH, "")
    if host_path:
        env["PATH"] = f"{env.get('PATH', '')}:{host_path}"
    proc = subprocess.Popen(["/bin/sh", "-c", command], env=env)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))
