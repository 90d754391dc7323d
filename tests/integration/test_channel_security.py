"""Channel hardening: the secret file, who may join, what a peer's bytes can do, Publish paths.

Every attack here runs against the real listener, handshake and reader: impostors and raw
peers are plain sockets speaking (or mangling) the protocol.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.dist_util import REPO_ROOT
from tsync_mcore.channel.secret import load_secret


def test_concurrent_launchers_agree_on_one_secret(tmp_path):
    # As torchrun's ranks and the rollout launcher do: all at once, none sees a partial file.
    path = str(tmp_path / "channel.secret")
    code = (f"from tsync_mcore.channel import load_or_create_secret as f;"
            f"print(f({path!r}).hex())")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(6)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(keys) == 1
    assert bytes.fromhex(keys.pop()) == load_secret(path)
