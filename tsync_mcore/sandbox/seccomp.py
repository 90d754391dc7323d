"""The jail's seccomp filter: a classic-BPF program, built here and installed by the launcher
(tsync_mcore/sandbox/launcher.py) with no-new-privs just before it execs the program.

It denies, with EPERM, the system calls a jailed program has no use for and that widen the
kernel surface or undo the jail: new namespaces (`unshare`, `setns`, `clone` with a
CLONE_NEW* flag; `clone3` gets ENOSYS, so libc falls back to `clone`, whose flags a filter
can read), mounts of any kind, keyrings, tracing other processes (`ptrace`,
`process_vm_*`, `pidfd_getfd`, `kcmp`), `bpf`, `perf_event_open`, `userfaultfd`,
`io_uring`, kernel modules and kexec, and host-wide settings (clock, hostname, swap,
reboot, quotas); sockets of families other than Unix, IPv4/6 and netlink get
EAFNOSUPPORT (no AF_VSOCK to the hypervisor, no AF_ALG, AF_PACKET, ...). Another
architecture's calls (i386 on x86_64, x32) kill the process.
"""

from __future__ import annotations

import platform
import struct

# (x86_64, aarch64) numbers; None: the call does not exist there
_DENY: dict[str, tuple[int | None, int]] = {
    "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272), "process_madvise": (440, 440),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "lookup_dcookie": (212, 18), "fanotify_init": (300, 262),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "adjtimex": (159, 171), "sethostname": (170, 161), "setdomainname": (171, 162),
    "quotactl": (179, 60), "quotactl_fd": (443, 443), "syslog": (103, 116),
    "vhangup": (153, 58), "move_pages": (279, 239), "migrate_pages": (256, 238),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None),
    "uselib": (134, None), "_sysctl": (156, None), "nfsservctl": (180, None),
}
_CLONE, _CLONE3, _SOCKET = (56, 220), (435, 435), (41, 198)
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 \
    | 0x40000000
# socket families a program may open: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (getaddrinfo
# asks the kernel for the addresses); others (AF_VSOCK to a hypervisor, AF_PACKET, AF_ALG,
# ...) get EAFNOSUPPORT
FAMILIES = (1, 2, 10, 16)
_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # AUDIT_ARCH_*
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97

_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000


def supported() -> str:
    """Why no filter can be built for this machine ("" : one can)."""
    m = platform.machine()
    return "" if m in _ARCH else f"no seccomp filter for architecture {m!r}"


def program() -> bytes:
    """The filter as struct sock_filter[] bytes for this machine's architecture."""
    col, arch = _ARCH[platform.machine()]
    deny = sorted({nrs[col] for nrs in _DENY.values() if nrs[col] is not None})
    # (label or None, code, jump if true, jump if false, k); jumps name a label or are 0
    ins: list[tuple] = [
        (None, _LD_ABS, 0, 0, 4),  # seccomp_data.arch
        (None, _JEQ, 0, "kill", arch),
        (None, _LD_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if col == 0:  # x32 calls (nr | 0x40000000) are another ABI
        ins.append((None, _JGE, "kill", 0, 0x40000000))
    ins += [(None, _JEQ, "eperm", 0, nr) for nr in deny]
    ins += [(None, _JEQ, "enosys", 0, _CLONE3[col]),
            (None, _JEQ, "socket", 0, _SOCKET[col]),
            (None, _JEQ, 0, "allow", _CLONE[col]),
            (None, _LD_ABS, 0, 0, 16),  # args[0]: clone's flags (low 32 bits, little-endian)
            (None, _JSET, "eperm", "allow", NS_FLAGS),
            ("socket", _LD_ABS, 0, 0, 16)]  # args[0]: the family
    ins += [(None, _JEQ, "allow", 0, f) for f in FAMILIES]
    ins += [(None, _RET, 0, 0, _ERRNO | _EAFNOSUPPORT),
            ("allow", _RET, 0, 0, _ALLOW), ("eperm", _RET, 0, 0, _ERRNO | _EPERM),
            ("enosys", _RET, 0, 0, _ERRNO | _ENOSYS), ("kill", _RET, 0, 0, _KILL)]
    at = {label: i for i, (label, *_) in enumerate(ins) if label}
    out = b""
    for i, (_, code, jt, jf, k) in enumerate(ins):
        jt = at[jt] - i - 1 if isinstance(jt, str) else jt
        jf = at[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out
