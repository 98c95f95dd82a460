"""A seccomp filter for the sandbox: the kernel's namespace, mount, module, BPF, io_uring, ptrace
and NUMA surfaces answer EPERM, and so do the ways to hold memory outside any process (memfd, SysV
IPC), whatever the code inside tries.

bubblewrap loads it (`--seccomp FD`) as the last step before it runs the sandboxed program, so the
program and everything it starts inherit it. Without it, a program in the sandbox could create a
user namespace of its own (as `nobody` too) and reach kernel code that unprivileged users never
reach otherwise (nf_tables in a fresh network namespace is where most recent local privilege
escalations lived).

The filter is a deny-list in classic BPF, hand-assembled here because the well-kept route
(libseccomp) has no binding on PyPI (Debian's python3-seccomp does not install into a venv, and
the PyPI wrappers are 0.x ctypes shims that still need the C library): a few rows per rule are
easier to audit than a dependency. A deny-list only knows the syscalls it was written against, so
every number above `LAST_KNOWN` (a syscall a later kernel adds) is refused with ENOSYS, the answer
libc takes as "fall back to the older call". docs/safety.md compares it, row by row, with moby's
default profile and flatpak's. Architectures: x86-64 and aarch64; elsewhere `filter_program()`
returns None and the sandbox says so in its start line.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# seccomp_data: nr at 0, arch at 4, instruction pointer at 8, args from 16 (8 bytes each, the low
# 32 bits first on these little-endian machines; every argument checked here is a 32-bit int)
_NR, _ARCH = 0, 4
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000
_X32_BIT = 0x40000000

LAST_KNOWN = 470   # listns (Linux 6.19), the newest syscall the tables below were checked against


def _arg(i: int) -> int:
    return 16 + 8 * i


# clone() flags that make a new namespace (a new user namespace above all)
CLONE_NAMESPACES = (0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                    | 0x20000000 | 0x40000000)
AF_UNIX = 1                               # the one socket family allowed (socket, socketpair)
# personality(): Linux, its 32-bit flavour, the UNAME26 flag on either, and the query (moby's list)
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
TTY_IOCTLS = (0x5412, 0x541C)             # TIOCSTI, TIOCLINUX: typing into a terminal (flatpak)
SOL_SOCKET = 1
# larger socket buffers: without a memory cgroup nothing counts them (each socket keeps its
# default, net.core.wmem_default; the number of sockets is bounded by the open-file limit)
BUFFER_OPTIONS = (7, 8, 32, 33)           # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE

DENIED = (
    # namespaces, mounts and the machine's own state
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "open_tree_attr",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "adjtimex",
    "clock_adjtime", "sethostname", "setdomainname", "syslog", "vhangup", "lookup_dcookie",
    "fanotify_init", "lsm_set_self_attr", "listns",
    # kernel surface no program here needs (keyrings, BPF, io_uring, file handles, I/O ports)
    "keyctl", "add_key", "request_key", "bpf", "userfaultfd", "perf_event_open", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at", "uselib",
    "ustat", "sysfs", "_sysctl", "modify_ldt", "iopl", "ioperm", "uprobe",
    # other processes: tracing them, their memory, their file descriptors
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
    "process_mrelease",
    # NUMA placement (another process's pages, kernel memory policy)
    "mbind", "set_mempolicy", "get_mempolicy", "migrate_pages", "move_pages",
    "set_mempolicy_home_node",
    # memory held outside any process's address space, which no per-process limit counts
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd",
    "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop", "mq_open")

# (AUDIT_ARCH, syscall numbers) from the kernel's tables (Linux 6.19); a name an architecture
# lacks is not there (x86-64's legacy calls)
_X86_64 = (0xC000003E, dict(
    unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161, open_tree=428,
    open_tree_attr=467, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
    mount_setattr=442, kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313,
    delete_module=176, reboot=169, swapon=167, swapoff=168, acct=163, quotactl=179,
    quotactl_fd=443, settimeofday=164, clock_settime=227, adjtimex=159, clock_adjtime=305,
    sethostname=170, setdomainname=171, syslog=103, vhangup=153, lookup_dcookie=212,
    fanotify_init=300, lsm_set_self_attr=460, listns=470,
    keyctl=250, add_key=248, request_key=249, bpf=321, userfaultfd=323, perf_event_open=298,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_by_handle_at=304,
    name_to_handle_at=303, uselib=134, ustat=136, sysfs=139, _sysctl=156, modify_ldt=154,
    iopl=172, ioperm=173, uprobe=336,
    ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312, pidfd_getfd=438,
    process_madvise=440, process_mrelease=448,
    mbind=237, set_mempolicy=238, get_mempolicy=239, migrate_pages=256, move_pages=279,
    set_mempolicy_home_node=450,
    memfd_create=319, memfd_secret=447, shmget=29, shmat=30, shmdt=67, shmctl=31, msgget=68,
    msgsnd=69, msgrcv=70, msgctl=71, semget=64, semop=65, semctl=66, semtimedop=220, mq_open=240,
    clone=56, clone3=435, socket=41, socketpair=53, setsockopt=54, ioctl=16, personality=135))
_AARCH64 = (0xC00000B7, dict(
    unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, open_tree=428,
    open_tree_attr=467, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
    mount_setattr=442, kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
    delete_module=106, reboot=142, swapon=224, swapoff=225, acct=89, quotactl=60,
    quotactl_fd=443, settimeofday=170, clock_settime=112, adjtimex=171, clock_adjtime=266,
    sethostname=161, setdomainname=162, syslog=116, vhangup=58, lookup_dcookie=18,
    fanotify_init=262, lsm_set_self_attr=460, listns=470,
    keyctl=219, add_key=217, request_key=218, bpf=280, userfaultfd=282, perf_event_open=241,
    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_by_handle_at=265,
    name_to_handle_at=264,
    ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, pidfd_getfd=438,
    process_madvise=440, process_mrelease=448,
    mbind=235, set_mempolicy=237, get_mempolicy=236, migrate_pages=238, move_pages=239,
    set_mempolicy_home_node=450,
    memfd_create=279, memfd_secret=447, shmget=194, shmat=196, shmdt=197, shmctl=195, msgget=186,
    msgsnd=189, msgrcv=188, msgctl=187, semget=190, semop=193, semctl=191, semtimedop=192,
    mq_open=180,
    clone=220, clone3=435, socket=198, socketpair=199, setsockopt=208, ioctl=29, personality=92))
ARCHES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}

# syscalls allowed or refused by their arguments: name -> the label of their check below
_CHECKED = {"clone": "clone", "clone3": "enosys", "socket": "family", "socketpair": "family",
            "personality": "personality", "ioctl": "ioctl", "setsockopt": "sockopt"}


def _assemble(program: list[tuple]) -> bytes:
    """(code, jump-if-true label, jump-if-false label, k) rows, labels resolved to the relative
    offsets classic BPF wants (forward, at most 255); a row that is a str is a label for the next
    instruction."""
    labels, rows = {}, []
    for row in program:
        if isinstance(row, str):
            labels[row] = len(rows)
        else:
            rows.append(row)
    out = b""
    for i, (code, jt, jf, k) in enumerate(rows):
        off = [0 if j is None else labels[j] - i - 1 for j in (jt, jf)]
        if not all(0 <= o <= 255 for o in off):
            raise ValueError(f"seccomp row {i}: a jump of {off} does not fit classic BPF")
        out += struct.pack("=HBBI", code, *off, k)
    return out


def _argument_checks() -> list:
    """The checks `_CHECKED` jumps to, each ending in a verdict."""
    ret = lambda verdict: (_RET, None, None, verdict)   # noqa: E731
    load = lambda offset: (_LD_ABS, None, None, offset)  # noqa: E731
    return [
        "clone", load(_arg(0)), (_JSET, "eperm", None, CLONE_NAMESPACES), ret(_ALLOW),
        "family", load(_arg(0)), (_JEQ, "allow", "eafnosupport", AF_UNIX),
        "personality", load(_arg(0)), *[(_JEQ, "allow", None, p) for p in PERSONALITIES],
        (_RET, None, None, _ERRNO | errno.EPERM),
        "ioctl", load(_arg(1)), *[(_JEQ, "eperm", None, c) for c in TTY_IOCTLS], ret(_ALLOW),
        "sockopt", load(_arg(1)), (_JEQ, None, "allow", SOL_SOCKET), load(_arg(2)),
        *[(_JEQ, "eperm", None, o) for o in BUFFER_OPTIONS],
        "allow", ret(_ALLOW),
        "eperm", ret(_ERRNO | errno.EPERM),
        "enosys", ret(_ERRNO | errno.ENOSYS),
        "eafnosupport", ret(_ERRNO | errno.EAFNOSUPPORT),
        "kill", ret(_KILL)]


def filter_program(machine: str | None = None) -> bytes | None:
    """The compiled filter for this machine's architecture (None: not one listed above).

        arch != ours                      -> kill (a syscall through another ABI)
        x32 syscall numbers (x86-64)      -> EPERM
        a number above LAST_KNOWN         -> ENOSYS (newer than this table)
        a DENIED syscall                  -> EPERM
        clone with a namespace flag       -> EPERM
        clone3                            -> ENOSYS (its flags sit in memory a filter cannot read;
                                             the C library then falls back to clone)
        socket, socketpair not AF_UNIX    -> EAFNOSUPPORT
        personality not in PERSONALITIES  -> EPERM
        ioctl TIOCSTI, TIOCLINUX          -> EPERM
        setsockopt of a buffer size       -> EPERM
        anything else                     -> allowed
    """
    arch = ARCHES.get((machine or platform.machine()).lower())
    if arch is None:
        return None
    audit, nr = arch
    program: list = [(_LD_ABS, None, None, _ARCH), (_JEQ, None, "kill", audit),
                     (_LD_ABS, None, None, _NR)]
    if audit == _X86_64[0]:
        program.append((_JGE, "eperm", None, _X32_BIT))
    program.append((_JGE, "enosys", None, LAST_KNOWN + 1))
    program += [(_JEQ, "eperm", None, nr[name]) for name in DENIED if name in nr]
    program += [(_JEQ, label, None, nr[name]) for name, label in _CHECKED.items()]
    program += [(_RET, None, None, _ALLOW), *_argument_checks()]
    return _assemble(program)


def filter_fd() -> int | None:
    """A file descriptor holding the filter, positioned at its start (bwrap reads it to the
    end), or None where there is no filter for this architecture. The caller closes it."""
    program = filter_program()
    if program is None:
        return None
    fd = os.memfd_create("posttrain-seccomp", 0)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -- prctl: the same filter without bubblewrap, and the process flags the sandbox sets ------------

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP = 1, 4, 22
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS, _SECCOMP_MODE_FILTER = 36, 38, 2


def _prctl(what: str, option: int, *args) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    args = [a if isinstance(a, ctypes._SimpleCData) or not isinstance(a, int) else ctypes.c_ulong(a)
            for a in args] + [ctypes.c_ulong(0)] * (4 - len(args))
    if libc.prctl(ctypes.c_int(option), *args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


class ChildSetup:
    """What a fallback child does between fork and exec: die with the trainer and (with a
    filter for this architecture) load the seccomp filter. Everything is prepared here, in the
    parent: a forked child of a multi-threaded trainer must not load libraries or allocate
    (another thread may have held the loader's lock at the fork), so `__call__` only makes the
    prctl calls on ready objects."""

    def __init__(self, with_filter: bool) -> None:
        import ctypes
        import signal

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        self.prctl = ctypes.CDLL(None, use_errno=True).prctl
        self.ulong, self.args0 = ctypes.c_ulong, [ctypes.c_ulong(0)] * 3
        self.sigkill = ctypes.c_ulong(int(signal.SIGKILL))
        program = filter_program() if with_filter else None
        self.buf = None if program is None else ctypes.create_string_buffer(program, len(program))
        self.prog = None if program is None else ctypes.byref(
            SockFprog(len(program) // 8, ctypes.cast(self.buf, ctypes.c_void_p)))
        self.one, self.mode = ctypes.c_ulong(1), ctypes.c_ulong(_SECCOMP_MODE_FILTER)
        self.zero = ctypes.c_ulong(0)

    def __call__(self) -> None:
        z = self.zero
        self.prctl(_PR_SET_PDEATHSIG, self.sigkill, z, z, z)
        if self.prog is not None:
            if self.prctl(_PR_SET_NO_NEW_PRIVS, self.one, z, z, z) != 0 or \
                    self.prctl(_PR_SET_SECCOMP, self.mode, self.prog, z, z) != 0:
                raise OSError("the seccomp filter could not be loaded")


def install() -> bool:
    """Load the filter into this process (and everything it starts). False where there is no
    filter for this architecture."""
    setup = ChildSetup(with_filter=True)
    if setup.prog is None:
        return False
    setup.prctl(_PR_SET_NO_NEW_PRIVS, setup.one, setup.zero, setup.zero, setup.zero)
    if setup.prctl(_PR_SET_SECCOMP, setup.mode, setup.prog, setup.zero, setup.zero) != 0:
        raise OSError("the seccomp filter could not be loaded")
    return True


def not_dumpable() -> None:
    """Other processes of the same user can no longer open this one's /proc files (its pipes
    under /proc/PID/fd, its memory)."""
    _prctl("dumpable", _PR_SET_DUMPABLE, 0)


def subreaper() -> None:
    """Orphans below this process (a grandchild that called setsid) become its children rather
    than init's, so they stay in its tree and can be found and killed."""
    _prctl("subreaper", _PR_SET_CHILD_SUBREAPER, 1)
