"""Channel codec and MAC CPU cost per message: TrajectoryMsg of 200 / 256 / 4k / 32k tokens and
a 160-token OPD TurnMsg.

    python -m perf.studies.wire_codec

encode = `wire.encode_arrays`; encode+frame = what `Link.send` does before its socket write,
without the MAC; decode = what a link's reader does after reading a frame (header check,
views of the body, `decode_arrays`); mac = the HMAC-SHA256 tag of one frame (the sender
computes it once, the receiver once more). Minimum over repeats: the least-disturbed figure
on a shared machine. The last column puts the MAC (both sides) against `--serve-ms`, the
serving time of one source (perf/README.md): the MAC must stay under 1 % of it.
"""

import argparse
import os
import timeit

from tsync_mcore.channel import TrajectoryMsg, TurnMsg, wire
from tsync_mcore.channel.handshake import Mac
from tsync_mcore.channel.link import _HEADER_BYTES, _body_bytes, _layout, _pack, _unpack
from tsync_mcore.channel.sources import TrajectorySource, TurnSource


def traj(n: int) -> TrajectoryMsg:
    prompt = n * 3 // 10
    return TrajectoryMsg(TrajectorySource("traj-000123", "group-0042",
                                          tuple(1000 + i % 150_000 for i in range(n)),
                                          (0,) * prompt + (1,) * (n - prompt), 0.75, 12, 37,
                                          prompt))


TURN = TurnMsg(TurnSource("traj-000123", "group-0042", 3, 8, 512, tuple(range(2000, 2160)),
                          (0,) * 40 + (1,) * 120,
                          (None,) * 40 + tuple(-0.01 * i for i in range(120)), 12, 91, 60))


def read(frame):
    header = frame[:_HEADER_BYTES].view("<i8").tolist()
    kind, specs = wire.check_header_values(header)
    layout = _layout(specs)
    body = frame[_HEADER_BYTES:_HEADER_BYTES + _body_bytes(layout)]
    return wire.decode_arrays(kind, header, _unpack(body, layout))


def best_us(fn, budget_s: float = 0.4) -> float:
    number = max(1, int(budget_s / 20 / max(timeit.timeit(fn, number=1), 1e-7)))
    return min(timeit.repeat(fn, number=number, repeat=20)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--serve-ms", type=float, default=27.8,
                    help="serving time of one source (default: the CPU overlap benchmark's "
                         "sync per-source CPU, perf/README.md)")
    args = ap.parse_args()
    mac = Mac(os.urandom(32))
    print(f"{'message':24s} {'frame B':>8s} {'encode':>9s} {'enc+frame':>10s} {'decode':>9s} "
          f"{'mac':>9s}  mac×2 / serve")
    cases = [(f"TrajectoryMsg {n} tok", traj(n)) for n in (200, 256, 4096, 32768)]
    for name, msg in cases + [("TurnMsg OPD 160 tok", TURN)]:
        frame = _pack(*wire.encode_arrays(msg))
        assert read(frame) == msg
        cells = [best_us(lambda: wire.encode_arrays(msg)),
                 best_us(lambda: _pack(*wire.encode_arrays(msg))),
                 best_us(lambda: read(frame)),
                 best_us(lambda: Mac.tag(mac.begin(frame), 7))]
        print(f"{name:24s} {frame.nbytes:8d}" + "".join(f" {c:7.1f}µs" for c in cells)
              + f"  {2 * cells[3] / (args.serve_ms * 1e3) * 100:6.3f} %")


if __name__ == "__main__":
    main()
