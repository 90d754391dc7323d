"""A local process outside the run that goes for the publication group's store.

Usage: publish_outsider.py PORT WORLD SECONDS
From before the store exists it keeps (1) a raw connection open on the port and idle (a
slow client the store must not wait for), and (2) tries to reach it as a c10d TCPStore
client; once in, it reads the group's token from the listed keys and joins the group as
rank 0 with gloo, ahead of the learner. Prints one line per event; "JOINED" if it did.
"""

import datetime
import re
import socket
import sys
import time

from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore


def main(port: int, world: int, seconds: float) -> None:
    print("READY", flush=True)
    deadline, idle = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        if idle is None:
            try:
                idle = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                print("IDLE CONNECTION OPEN", flush=True)
            except OSError:
                pass
        try:
            store = TCPStore("127.0.0.1", port, is_master=False,
                             timeout=datetime.timedelta(seconds=1))
            keys = store.list_keys()
        except Exception as e:  # noqa: BLE001 — not there yet, or not a TCPStore
            print(f"STORE REFUSED {str(e).splitlines()[0][:120]}", flush=True)
            time.sleep(0.05)
            continue
        tokens = {m.group(1) for k in keys if (m := re.match(r"tsync-publish/([0-9a-f]+)", k))}
        if not tokens:
            time.sleep(0.02)
            continue
        token = tokens.pop()
        print(f"TOKEN {token}", flush=True)
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=10)
        opts._devices = [ProcessGroupGloo.create_default_device()]
        try:
            ProcessGroupGloo(PrefixStore(f"tsync-publish/{token}", store), 0, world, opts)
            print("JOINED", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"JOIN FAILED {str(e).splitlines()[0][:120]}", flush=True)
        return
    print("GAVE UP", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
