"""Starting a program in the sandbox: which isolation (`decide`), and the process itself (`spawn`).

Three modes (docs/safety.md says what each stops and what it does not):

- 'bwrap': bubblewrap (Debian's `bubblewrap`), chosen over nsjail and firejail because it is
  small, needs no daemon and no setuid helper, is what Flatpak builds on, and works both
  unprivileged (user namespaces) and as root. The program gets its own PID, network, IPC and UTS
  namespaces (no other process visible, only a loopback with nothing on it), a private /proc, an
  empty /tmp and /dev/shm on size-bounded tmpfs, a read-only /dev, read-only /usr and /lib, the
  interpreter and its standard library (not the rest of its prefix: a conda env's `conda-meta`
  and `etc` hold its settings), the paths its caller names, and nothing else: no home, no run
  folder, no /etc. A seccomp filter (seccomp.py) refuses new namespaces, mounts, ptrace, BPF,
  io_uring, memory outside processes (memfd, SysV IPC) and every socket family but AF_UNIX. It
  dies with the trainer (--die-with-parent); when its first process ends the kernel kills every
  process in its PID namespace. As root, the program drops to uid 65534 (nobody)
  with no capabilities (setpriv), so the process-count limit holds (the kernel never applies
  RLIMIT_NPROC to root) and root-owned files stay closed.
- 'fallback' (no bubblewrap, or no namespaces): the program runs in its own session, in an empty
  temporary folder, with an empty environment, /dev/null as stdin, the same seccomp filter and
  resource limits, and it dies with the trainer. It can still read and write what the user can,
  see the trainer in /proc, connect to Unix sockets, and a grandchild that calls `setsid` leaves
  the group (not its cgroup). `auto` picks it only for a normal user's scorers that parse and compare answers;
  anything that runs the model's text as code, and anything as root, must name it.
- 'off' (rewards only, `reward.sandbox off`): the user's reward functions need files or the
  network; they run in their own processes with the user's environment, nothing contained.

'bwrap' and 'fallback' get a memory cgroup of their own where the machine allows one (cgroup.py:
memory, no swap, a process count, all of it killed when the call ends); where it does not, or
making one fails, the sandbox runs without it, the run says so once, loudly, and the filter and
the open-file limit bound what lives outside processes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from posttrain.sandbox import cgroup, seccomp
from posttrain.sandbox.procs import kill_tree, user_tasks

log = logging.getLogger("posttrain")

Mode = Literal["bwrap", "fallback", "off"]
NOBODY = 65534
BASE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Limits:
    timeout_s: float | None = 5.0       # wall clock, and CPU seconds (None: the caller bounds it)
    memory_mb: int = 512                # all its processes together (PSS), and each one's address space
    max_procs: int = 32                 # processes (threads) it may run at once
    max_file_mb: int = 16               # largest file it may write
    max_files: int = 64                 # open files per process (its pipe and socket buffers too)
    tmp_mb: int = 64                    # bwrap: size of its /tmp, and of its /dev/shm
    max_output: int = 2000              # bytes of stdout + stderr kept; past them it is killed


class SandboxError(ValueError):
    """The sandbox asked for cannot start here, or would be weaker than the user accepted."""


class SandboxStartError(RuntimeError):
    """A sandbox that was decided on failed to start a program (the tool is broken, not the
    model's program)."""


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot start a sandbox here (None: it can). Tried once per process with the
    real options (namespaces, seccomp filter, the drop to nobody). POSTTRAIN_FORCE_NO_BWRAP=1
    answers as a machine without it would (tests of the fallback decision)."""
    if os.environ.get("POSTTRAIN_FORCE_NO_BWRAP") == "1":
        return "POSTTRAIN_FORCE_NO_BWRAP=1"
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    sp = None
    try:
        sp = spawn([python_executable(), "-I", "-S", "-c", "print(6*7)"], "bwrap", Limits(timeout_s=30),
                   memory_cgroup=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = sp.proc.communicate(timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if sp is not None:
            if sp.proc.poll() is None:
                kill_tree(sp.proc.pid)
                sp.proc.wait()
            sp.close()
    if sp.proc.returncode == 0 and out.strip() == b"42":
        return None
    return " ".join(err.decode(errors="replace").split())[:200] or f"exit status {sp.proc.returncode}"


def bwrap_works() -> bool:
    return bwrap_problem() is None


def decide(requested: str, what: str, option: str,
           runs: str | None = "the code the model writes") -> Mode:
    """The mode to run `what` in, for the user's `option` value `requested`. `runs`: what of the
    model's text `what` executes or evaluates as code (None: it only parses and compares it).

        'bwrap'    -> bwrap, or SandboxError where it cannot start
        'fallback' -> fallback (asked for by name: the user accepted it)
        'off'      -> off (rewards only: asked for by name)
        'auto'     -> bwrap where it starts. Else SandboxError when `what` runs the model's text
                      as code (`runs`) or the trainer is root (root without namespaces is the
                      whole machine); for a normal user's parse-and-compare scorers, fallback
                      with a warning
    """
    mode = requested if requested in ("fallback", "off") else _auto_or_bwrap(requested, what,
                                                                             option, runs)
    if mode != "off":
        _say_memory_bound()
    return mode  # type: ignore[return-value]


def _auto_or_bwrap(requested: str, what: str, option: str, runs: str | None) -> Mode:
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    fix = "install it (apt-get install bubblewrap; without root it needs user namespaces)"
    if requested == "bwrap":
        raise SandboxError(f"{option}=bwrap but bubblewrap cannot start a sandbox here ({problem}): "
                           f"{fix}, or set {option} auto")
    if is_root():
        raise SandboxError(f"{what} would run as root without a namespace sandbox: bubblewrap cannot "
                           f"start here ({problem}). {fix[0].upper()}{fix[1:]}, or set {option} "
                           "fallback to accept the weaker isolation (docs/safety.md)")
    if runs is not None:
        raise SandboxError(f"{what} would run {runs} without a namespace sandbox: bubblewrap cannot "
                           f"start here ({problem}). {fix[0].upper()}{fix[1:]}, or set {option} "
                           "fallback to accept what the fallback allows (your files, the trainer's "
                           "environment and Unix sockets in reach: docs/safety.md)")
    log.warning("SANDBOX FALLBACK: %s runs without bubblewrap (%s): no namespaces, it can read "
                "your files and the trainer's environment, and leave files in the machine's "
                "/dev/shm (RAM: 16 MB a file, any number of them, up to half of the memory; they "
                "outlive the call) (docs/safety.md); %s, or set %s fallback to silence this",
                what, problem, fix, option)
    return "fallback"


def _say_memory_bound() -> None:
    """Loudly, once per process and message, where the sandbox's memory cannot be bounded as a
    whole: no cgroup, or one whose swap cannot be limited."""
    why = cgroup.problem()
    if why is None:
        if not cgroup.layout()[0].swap:
            _warn_once("SANDBOX MEMORY: each sandbox gets a memory cgroup, but its swap cannot be "
                       "limited here (swap accounting is off: no memory.swap.max or "
                       "memory.memsw.limit_in_bytes): what it holds in shared memory and tmpfs "
                       "files can go to swap past its limit (docs/safety.md)")
        return
    refused = ("memfd, SysV IPC and bigger socket buffers are refused by the syscall filter"
               if seccomp.filter_program() is not None else
               f"there is no syscall filter for {os.uname().machine}: memfd, SysV IPC and bigger "
               "socket buffers are open")
    _warn_once(f"SANDBOX MEMORY: no memory cgroup for the sandbox here ({why}): its memory is "
               f"bounded per process and by a check of its processes' memory in all; {refused}, "
               "open files are capped per process, but its pipe and socket buffers, /tmp and "
               "/dev/shm are not counted (bwrap: tmpfs of tmp_mb each; the fallback: the "
               "machine's /dev/shm, 16 MB a file, any number of files: up to half of the "
               "memory, and they outlive the call) (docs/safety.md)")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def is_root() -> bool:
    return os.geteuid() == 0


def python_executable() -> str:
    """The real interpreter (a venv's python is a link to it; the sandbox sees no venv)."""
    return os.path.realpath(sys.executable)


def python_paths() -> list[str]:
    """What `python -I` needs: the interpreter and its prefix's lib/ (the standard library and
    the interpreter's shared libraries), not the rest of the prefix."""
    return [python_executable(), os.path.join(os.path.realpath(sys.base_prefix), "lib")]


def bwrap_argv(limits: Limits, ro_paths: Sequence[str], env: dict[str, str],
               seccomp_fd: int | None, status_fd: int) -> list[str]:
    root = os.geteuid() == 0
    argv = ["bwrap", "--die-with-parent", "--new-session", "--json-status-fd", str(status_fd)]
    if root:   # namespaces without a user namespace, then drop to nobody with setpriv below
        argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:      # (--disable-userns: no user namespace inside this one)
        argv += ["--unshare-user", "--unshare-all", "--disable-userns"]
    size = str(limits.tmp_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    # (after /tmp's tmpfs: a path bound under /tmp, a reward module there, lands inside it)
    argv += _binds(["/usr", "/bin", "/lib", "/lib64", "/lib32", *python_paths(), *ro_paths])
    argv += ["--chdir", "/tmp", "--clearenv"]
    for key, value in {**BASE_ENV, "HOME": "/tmp", **env}.items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv.append("--")
    if root:
        argv += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    return argv


def _binds(paths: Sequence[str]) -> list[str]:
    """Read-only binds at their own paths. The folders above a bound path exist in the sandbox
    as empty, traversable folders (bubblewrap would make them 0700, closed to nobody); a path
    inside one already bound is left to it (no folder can be made in a read-only bind)."""
    argv, bound, made = [], [], {"/tmp", "/dev", "/proc"}   # (mounted already: left as they are)

    def inside(p: str) -> bool:
        return any(p == b or p.startswith(b.rstrip("/") + "/") for b in bound)

    for path in dict.fromkeys(paths):
        if not os.path.exists(path) or inside(path):
            continue
        for parent in reversed(Path(path).parents[:-1]):   # (not "/")
            if str(parent) not in made and not inside(str(parent)):
                argv += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        argv += ["--ro-bind", path, path]
        bound.append(path)
    return argv


def _nproc(max_procs: int) -> int:
    """RLIMIT_NPROC counts every task of the real user: for root the limit applies only after the
    drop to nobody; for a normal user it is what already runs plus `max_procs`."""
    return max_procs if os.geteuid() == 0 else user_tasks(os.getuid()) + max_procs


def _preexec(limits: Limits, nproc: int, filter_in_child: bool, group: cgroup.Group | None):
    """Run in the child before it executes: resource limits (inherited by everything it starts),
    its cgroup, death with the trainer, and (fallback) the seccomp filter; every object it needs
    is made here, before the fork (seccomp.ChildSetup says why)."""
    import resource
    rows = [(resource.RLIMIT_AS, limits.memory_mb << 20),
            (resource.RLIMIT_FSIZE, limits.max_file_mb << 20),
            (resource.RLIMIT_NOFILE, _at_most_hard(resource.RLIMIT_NOFILE, limits.max_files)),
            (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)]
    if limits.timeout_s is not None:
        cpu = max(1, math.ceil(limits.timeout_s))
        rows.append((resource.RLIMIT_CPU, cpu))
    limits_ = [(name, (value, value + (name == resource.RLIMIT_CPU))) for name, value in rows]
    setup = seccomp.ChildSetup(with_filter=filter_in_child)

    def apply() -> None:
        for name, pair in limits_:
            resource.setrlimit(name, pair)
        if group is not None:
            group.join()
        setup()
    return apply


def _at_most_hard(name: int, value: int) -> int:
    """`value`, or the trainer's own hard limit where that is lower (it cannot be raised)."""
    import resource
    hard = resource.getrlimit(name)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


@dataclass
class Spawned:
    """A started sandbox: its process, (bwrap) the pipe on which bubblewrap reports on the
    program it runs, and its memory cgroup where the machine allows one."""

    proc: subprocess.Popen
    mode: Mode
    status_fd: int | None = None
    group: cgroup.Group | None = None
    _status: bytes = b""

    def program_ran(self) -> bool:
        """After the sandbox ended by itself: did the program in it run (bwrap reports its exit
        code; a sandbox that failed to set up reports none)? Always True for the other modes."""
        if self.status_fd is None:
            return True
        try:
            while chunk := os.read(self.status_fd, 4096):
                self._status += chunk
        except BlockingIOError:
            pass
        return b'"exit-code"' in self._status

    def oom_kills(self) -> int:
        """Processes of it the kernel killed for passing its memory cgroup's limit (0: none, or
        no cgroup)."""
        return self.group.oom_kills() if self.group is not None else 0

    def oom_killed(self) -> bool:
        return self.oom_kills() > 0

    def close(self) -> None:
        """After the caller killed and reaped it: its status pipe, and its cgroup with anything
        still inside (a grandchild that left the tree)."""
        if self.status_fd is not None:
            self.program_ran()
            os.close(self.status_fd)
            self.status_fd = None
        if self.group is not None:
            self.group.remove()
            self.group = None


@dataclass(frozen=True)
class _Program:
    """What `spawn` starts: the command, the environment it gets, its folder, the paths bwrap
    binds read-only, and the caller's other subprocess.Popen arguments (pipes, pass_fds)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    ro_paths: Sequence[str]
    popen: dict


def spawn(argv: list[str], mode: Mode, limits: Limits, *, ro_paths: Sequence[str] = (),
          env: dict[str, str] | None = None, cwd: str | None = None, memory_cgroup: bool = True,
          **popen) -> Spawned:
    """Start `argv` (an interpreter and its arguments) in `mode`. bwrap: `ro_paths` are bound
    read-only at their own paths, `env` is all the environment it gets. fallback: the same
    environment, `cwd` as its folder, the same limits. off: the caller's environment.
    `memory_cgroup` False: no cgroup (bwrap_problem's probe, which asks about bubblewrap alone)."""
    if mode == "off":
        return Spawned(subprocess.Popen(argv, cwd=cwd, start_new_session=True, **popen), mode)
    env = {**BASE_ENV, "HOME": cwd or "/tmp", **(env or {})}
    nproc = _nproc(limits.max_procs)
    group = None
    if memory_cgroup:
        # its /tmp and /dev/shm are memory too; bubblewrap's processes count in its process limit
        group = cgroup.make_group(limits.memory_mb + 2 * limits.tmp_mb, limits.max_procs + 4)
        if group is None:   # (a cgroup that could not be made: the one line, once)
            _say_memory_bound()
    try:
        return _start(_Program(argv, env, cwd, ro_paths, popen), mode, limits, nproc, group)
    except BaseException:
        if group is not None:
            group.remove()
        raise


def _start(program: _Program, mode: Mode, limits: Limits, nproc: int,
           group: cgroup.Group | None) -> Spawned:
    """Start `program` under `limits` ('bwrap' or 'fallback'), in `group` where there is one."""
    argv, env, cwd, popen = program.argv, program.env, program.cwd, dict(program.popen)
    if mode == "fallback":
        proc = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, close_fds=True,
                                preexec_fn=_preexec(limits, nproc, True, group), **popen)
        return Spawned(proc, mode, group=group)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    filter_fd = seccomp.filter_fd()
    fds = (write_end,) if filter_fd is None else (write_end, filter_fd)
    passed = tuple(popen.pop("pass_fds", ()))
    try:
        full = bwrap_argv(limits, program.ro_paths, {k: v for k, v in env.items() if k != "HOME"},
                          filter_fd, write_end) + argv
        proc = subprocess.Popen(full, cwd=cwd, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                start_new_session=True, close_fds=True, pass_fds=fds + passed,
                                preexec_fn=_preexec(limits, nproc, False, group), **popen)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return Spawned(proc, mode, read_end, group)
