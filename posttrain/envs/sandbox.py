"""Running code the policy wrote: out of the trainer's reach, time- and size-bounded.

Two modes (`env.sandbox`, docs/safety.md says what each stops and what it does not):

- 'bwrap': bubblewrap (Debian's `bubblewrap`), chosen over nsjail and firejail because it is
  small, needs no daemon and no setuid helper, is what Flatpak builds on, and works both
  unprivileged (user namespaces) and as root. The child gets its own PID, network, IPC and UTS
  namespaces (no other process visible, only a loopback with nothing on it), a private /proc, an
  empty /tmp on a tmpfs of `tmp_mb`, read-only /usr, /lib and Python's own install, and nothing
  else: no home, no run folder, no /etc. It dies with the trainer (--die-with-parent); when its
  first process ends the kernel kills every process in its PID namespace. As root, the child
  drops to uid 65534 (nobody) with no capabilities (setpriv), so the process-count limit holds
  (the kernel never applies RLIMIT_NPROC to root) and root-owned files stay closed.
- 'fallback' (no bwrap, or no namespaces): the child runs in its own session and process group,
  in an empty temporary folder, with an empty environment (only PATH), /dev/null as stdin and
  limits on memory, CPU time, file size and (for a non-root user) process count; its whole
  process group is killed on every exit path. It can still read what the user can read
  (/proc/<trainer>/environ included), reach the network, and a grandchild that calls `setsid`
  leaves the group.

In both modes at most `max_output` bytes of output are kept and the child is killed past them, so
a program that prints forever costs the trainer nothing; the wall clock is `timeout_s`.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

Mode = Literal["bwrap", "fallback"]
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0              # wall clock
    memory_mb: int = 512                # address space of each process
    max_procs: int = 32                 # processes of the sandbox's user
    max_file_mb: int = 16               # largest file it may write
    tmp_mb: int = 64                    # bwrap: size of its /tmp
    max_output: int = 2000              # bytes of stdout + stderr kept; past them it is killed


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    status: str                         # 'ok', 'error' (non-zero exit), 'timeout', 'output_limit'
    returncode: int | None
    seconds: float


@functools.cache
def bwrap_works() -> bool:
    """Can bubblewrap start a sandbox here (installed, namespaces allowed)? Tried once."""
    if shutil.which("bwrap") is None or (os.geteuid() == 0 and shutil.which("setpriv") is None):
        return False
    try:
        out = subprocess.run(_bwrap_prefix(Limits()) + [_python(), "-I", "-c", "print(6*7)"],
                             capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == "42"


def sandbox_mode(requested: str = "auto") -> Mode:
    """'auto': bwrap where it works, else the fallback; 'bwrap' where it does not: an error."""
    if requested == "fallback":
        return "fallback"
    if bwrap_works():
        return "bwrap"
    if requested == "bwrap":
        raise ValueError("env.sandbox='bwrap' but bubblewrap cannot start a sandbox here "
                         "(install it: apt-get install bubblewrap; it needs user namespaces "
                         "unless run as root); or set env.sandbox auto")
    return "fallback"


def _python() -> str:
    """The real interpreter (a venv's python is a link to it; the sandbox sees no venv)."""
    return os.path.realpath(sys.executable)


def _bwrap_prefix(limits: Limits) -> list[str]:
    root = os.geteuid() == 0
    prefix = os.path.realpath(sys.base_prefix)
    argv = ["bwrap", "--die-with-parent", "--new-session"]
    if root:   # namespaces without a user namespace, then drop to nobody with setpriv below
        argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                 "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all"]
    for path in dict.fromkeys(["/usr", "/bin", "/lib", "/lib64", "/lib32", prefix]):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb << 20),
             "--perms", "1777", "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--setenv", "LANG", "C.UTF-8", "--"]
    if root:
        argv += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
    return argv


def _set_limits(limits: Limits):
    """The child's resource limits, set in the child before it executes (inherited by bwrap's
    children and by everything the code starts)."""
    def apply() -> None:
        import resource
        mem = limits.memory_mb << 20
        cpu = max(1, math.ceil(limits.timeout_s))
        for name, value in ((resource.RLIMIT_AS, (mem, mem)), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                            (resource.RLIMIT_FSIZE, (limits.max_file_mb << 20,) * 2),
                            (resource.RLIMIT_CORE, (0, 0)),
                            (resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))):
            resource.setrlimit(name, value)
    return apply


def run_python_code(code: str, limits: Limits = Limits(), mode: Mode | None = None) -> Result:
    """Run `code` with `python -I` in the sandbox; what it printed, how it ended."""
    mode = mode or sandbox_mode()
    argv = [_python(), "-I", "-c", code]
    if mode == "bwrap":
        argv = _bwrap_prefix(limits) + argv
    with tempfile.TemporaryDirectory(prefix="posttrain-tool-") as cwd:
        return _run(argv, limits, cwd)


def _run(argv: list[str], limits: Limits, cwd: str) -> Result:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                            start_new_session=True, preexec_fn=_set_limits(limits), close_fds=True)
    status = "ok"
    try:
        out, err, status = _read_bounded(proc, limits, t0)
    finally:
        _kill_group(proc)
    code = proc.returncode
    if status == "ok" and code:
        status = "timeout" if code in (-signal.SIGXCPU, -signal.SIGKILL) else "error"
    return Result(out.decode(errors="replace"), err.decode(errors="replace"), status, code,
                  time.monotonic() - t0)


def _read_bounded(proc: subprocess.Popen, limits: Limits, t0: float) -> tuple[bytes, bytes, str]:
    """Both pipes until they close, at most `max_output` bytes in all; 'timeout' past the wall
    clock, 'output_limit' past the bytes (the group is killed by the caller either way)."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for pipe in bufs:
        sel.register(pipe, selectors.EVENT_READ)
    status, exited = "ok", False
    while sel.get_map():
        left = limits.timeout_s - (time.monotonic() - t0)
        if left <= 0:
            status = "timeout"
            break
        # once the child has exited, what is left in the pipes is read without waiting: a
        # grandchild that holds them open (fallback mode) must not keep the call going
        events = sel.select(timeout=0 if exited else min(left, 0.05))
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fileobj] += chunk
        if sum(map(len, bufs.values())) > limits.max_output:
            status = "output_limit"
            break
        if exited and not events:
            break
        exited = exited or proc.poll() is not None
    sel.close()
    if status == "ok":
        try:
            proc.wait(timeout=max(0.1, limits.timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            status = "timeout"
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), status


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it leads one: start_new_session) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    proc.wait()
