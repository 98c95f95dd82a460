"""A program run to its end in the sandbox (the python tool): what it printed, how it ended.

At most `max_output` bytes of output are kept and the program is killed past them, so one that
prints forever costs the trainer nothing; the wall clock is `timeout_s`; the memory of all its
processes together is checked every 50 ms against `memory_mb` (each process's address space is
also limited to it, so one allocation cannot outrun the check), and where the machine allows, a
memory cgroup bounds what it holds in processes and outside them (tmpfs files, pipe buffers;
launch.py); its whole tree is killed on every exit path. A sandbox that could not start is an error of the tool (`SandboxStartError`), never
the program's output.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from posttrain.sandbox.launch import Limits, Mode, SandboxStartError, python_executable, spawn
from posttrain.sandbox.procs import kill_tree, tree_memory_mb

_MEMORY_EVERY_S = 0.05


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    # 'ok', 'error' (non-zero exit), 'timeout', 'output_limit', 'memory_limit'
    status: str
    returncode: int | None
    seconds: float


def run_python_code(code: str, limits: Limits, mode: Mode) -> Result:
    """Run `code` with `python -I -S` in the sandbox: the standard library only (no site
    packages; `site` alone would double the start-up time)."""
    with tempfile.TemporaryDirectory(prefix="posttrain-tool-") as cwd:
        t0 = time.monotonic()
        sp = spawn([python_executable(), "-I", "-S", "-c", code], mode, limits, cwd=cwd,
                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err, status = _read_bounded(sp.proc, limits, t0)
        finally:
            _kill(sp.proc)
            ran, oom = sp.program_ran(), sp.oom_killed()
            sp.close()
    code_ = sp.proc.returncode
    if status == "ok" and not ran:   # (ended by itself, yet bubblewrap ran no program)
        raise SandboxStartError("bubblewrap could not start the sandbox: "
                                + " ".join(err.decode(errors="replace").split())[:300])
    if oom and status != "output_limit":   # (the kernel killed in its cgroup: memory in all)
        status = "memory_limit"
    if status == "ok" and code_:
        status = "timeout" if code_ in (-signal.SIGXCPU, -signal.SIGKILL) else "error"
    return Result(out.decode(errors="replace"), err.decode(errors="replace"), status, code_,
                  time.monotonic() - t0)


def _exited(proc: subprocess.Popen) -> bool:
    """Has the child exited? Asked without reaping it: its pid stays its own (a zombie) until
    `_kill` has killed its whole tree and group, so no pid the kernel reuses is ever signalled."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read_bounded(proc: subprocess.Popen, limits: Limits, t0: float) -> tuple[bytes, bytes, str]:
    """Both pipes until they close, at most `max_output` bytes in all; 'timeout' past the wall
    clock, 'output_limit' past the bytes, 'memory_limit' past the memory (the tree is killed by
    the caller in every case)."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for pipe in bufs:
        sel.register(pipe, selectors.EVENT_READ)
    status, exited, checked = "ok", False, 0.0
    while sel.get_map():
        now = time.monotonic()
        left = limits.timeout_s - (now - t0)
        if left <= 0:
            status = "timeout"
            break
        if now - checked >= _MEMORY_EVERY_S:
            checked = now
            if tree_memory_mb(proc.pid) > limits.memory_mb:
                status = "memory_limit"
                break
        # once the child has exited, what is left in the pipes is read without waiting: a
        # grandchild that holds them open (fallback mode) must not keep the call going
        events = sel.select(timeout=0 if exited else min(left, _MEMORY_EVERY_S))
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
        exited = exited or _exited(proc)
    sel.close()
    while status == "ok" and not _exited(proc):   # (pipes closed, the process not gone yet)
        if time.monotonic() - t0 >= limits.timeout_s:
            status = "timeout"
        time.sleep(0.002)
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), status


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole tree and process group (it leads one; not reaped yet, its pid
    is still its own) and reap it."""
    kill_tree(proc.pid)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    proc.wait()


__all__ = ["Result", "run_python_code"]
