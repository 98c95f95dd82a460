"""Processes as /proc shows them: the tree under a sandbox (its memory in all, killing all of it)
and process groups that are safe to kill (a recorded leader checked by its start time, so a pid
the kernel handed to an unrelated process later is never mistaken for it). Linux only; elsewhere
every function sees no process."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgrp: int
    start: int          # start time in clock ticks after boot: (pid, start) names one process
    rss_kb: int


def read_proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state ppid pgrp ...
    return Proc(pid, int(f[1]), int(f[2]), int(f[19]), int(f[21]) * _PAGE_KB)


def processes() -> dict[int, Proc]:
    """Every process on this machine (that this user may see)."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        proc = read_proc(int(entry.name))
        if proc is not None:
            out[proc.pid] = proc
    return out


def start_time(pid: int) -> int | None:
    proc = read_proc(pid)
    return None if proc is None else proc.start


def descendants(root: int, table: dict[int, Proc] | None = None) -> list[int]:
    """`root` and every process below it (children, their children, ...)."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _pss_kb(pid: int, fallback: int) -> int:
    """Proportional set size: a page shared by n processes counts 1/n in each (forked workers
    share most of their memory; summing their RSS would count it n times)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return fallback


def tree_memory_mb(root: int) -> float:
    """The memory the process tree under `root` uses in all (PSS, MB)."""
    table = processes()
    return sum(_pss_kb(pid, table[pid].rss_kb) for pid in descendants(root, table)) / 1024


def kill_tree(root: int) -> int:
    """SIGKILL `root`'s process group and every process below it; how many were signalled."""
    pids = descendants(root)
    try:
        os.killpg(root, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def reap_groups(leaders: dict[int, int], leaders_too: bool = False) -> tuple[int, set[int]]:
    """Kill what is left in the process groups that `leaders` (pid -> start time) lead: forks a
    call left behind, and with `leaders_too` the leaders themselves. A group whose leader pid now
    belongs to another process (a later start time: the kernel reused the pid once the group was
    gone) is not ours and is left alone. Returns (processes killed, leaders to forget: gone, or
    their pid reused)."""
    table = processes()
    ours, forget = set(), set()
    for pid, start in leaders.items():
        now = table.get(pid)
        if now is not None and now.start != start:
            forget.add(pid)                      # pid reused: never touch that group
        elif now is None and not any(p.pgrp == pid for p in table.values()):
            forget.add(pid)                      # leader and group gone
        else:
            ours.add(pid)
    killed = 0
    for p in table.values():
        if p.pgrp in ours and (leaders_too or p.pid not in leaders):
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed, forget


def user_tasks(uid: int) -> int:
    """Threads of every process whose real user is `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (KeyError, ValueError, IndexError):
            continue
    return total
