"""Channel codec CPU cost per message: a 200-token TrajectoryMsg and a 160-token OPD TurnMsg.

    PYTHONPATH=. python perf/wire_codec.py

encode = `wire.encode`; encode+frame = what `Link.send` does before its gloo op;
decode = what a link's reader does after its recv (header check, views of the frame,
`decode_arrays`). Minimum over 60 repeats of 200 calls: the least-disturbed figure on a
shared machine.
"""

import timeit

import numpy as np

from tsync_mcore.channel import TrajectoryMsg, TurnMsg, wire
from tsync_mcore.channel.link import _HEADER_BYTES, _body_bytes, _frames, _unpack
from tsync_mcore.sources import TrajectorySource, TurnSource

TRAJ = TrajectoryMsg(TrajectorySource("traj-000123", "group-0042", tuple(range(1000, 1200)),
                                      (0,) * 60 + (1,) * 140, 0.75, 12, 37, 60))
TURN = TurnMsg(TurnSource("traj-000123", "group-0042", 3, 8, 512, tuple(range(2000, 2160)),
                          (0,) * 40 + (1,) * 120,
                          (None,) * 40 + tuple(-0.01 * i for i in range(120)), 12, 91, 60))


def read(frame):
    raw = frame.numpy()
    header = raw[:_HEADER_BYTES].view(np.int64).tolist()
    kind, specs = wire.check_header_values(header)
    body = raw[_HEADER_BYTES:_HEADER_BYTES + _body_bytes(specs)]
    return wire.decode_arrays(kind, header, _unpack(body, specs))


def main() -> None:
    for name, msg in (("TrajectoryMsg 200 tok", TRAJ), ("TurnMsg OPD 160 tok", TURN)):
        frame, body = _frames(wire.encode(msg))
        assert body is None and read(frame) == msg
        cells = {"encode": lambda: wire.encode(msg),
                 "encode+frame": lambda: _frames(wire.encode(msg)),
                 "decode": lambda: read(frame)}
        print(f"{name:22s}" + "".join(
            f"  {k} {min(timeit.repeat(fn, number=200, repeat=60)) / 200 * 1e6:6.1f} µs"
            for k, fn in cells.items()))


if __name__ == "__main__":
    main()
