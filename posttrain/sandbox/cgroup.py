"""The sandbox's memory as a whole: a cgroup of its own for each sandbox (memory, no swap, a
process count), where the machine lets posttrain make one.

The per-process limits (address space, the PSS watcher in run.py and rewards/pool.py) count memory
that processes map; a memory cgroup also counts what a program holds outside them (memfd and tmpfs
files, shared memory, pipe buffers, kernel objects), and the kernel reclaims or kills inside the
cgroup when the sum passes its limit, long before the machine's OOM killer would pick the trainer
or the engine.

Where a cgroup is made (never where it would escape a limit the trainer runs under):
- cgroup v2: below the trainer's own cgroup where that gives its children the memory controller
  (only the root cgroup can: a v2 cgroup that holds processes cannot); else beside it, in its
  parent, where the trainer's own cgroup has no memory limit (`memory.max` is `max`: none to
  escape), its parent gives children the memory controller and we may write there. The trainer
  itself is never moved.
- cgroup v1: below the trainer's cgroup in the `memory` hierarchy (and `pids`, where mounted);
  a child counts toward its parent's limit.
Elsewhere (a normal user, a read-only /sys/fs/cgroup, a private v2 namespace, a trainer under a
memory limit) `problem()` says why; the syscall filter (seccomp.py) and the open-file limit are
then the bound, and the run says so at its start.

Each group is named `posttrain-PID-START-MADE-RANDOM`: the trainer's pid and its start time
(/proc/PID/stat), the time it was made, and a random part, so a trainer that later gets a dead
one's pid, or one in another PID namespace, never takes or removes another's group. Before its
first group a trainer starts a small reaper that removes its groups when it ends, a SIGKILL
included (`_start_reaper`); a trainer also removes the groups of trainers that are gone
(`_sweep`), should a reaper have been killed too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_PREFIX = "posttrain-"
_FRESH_S = 60.0   # a group younger than this is never swept (its maker may be out of our sight)
_SWAP_FILES = ("memory.swap.max", "memory.memsw.limit_in_bytes")
_broken: list[str] = []   # why making a group failed: none is tried again in this process
_reaper_for: list[int] = []   # the pid whose groups a reaper removes when it ends (_start_reaper)
_reaper_fds: list[int] = []   # this side of its pipe: held open until the process ends
_reaper_lock = threading.Lock()

# The reaper: blocks on a pipe only its trainer holds; at EOF (the trainer ended, however: a
# SIGKILL included) it kills what is left in the trainer's groups and removes them.
# It repeats Sandbox.remove's kill-and-rmdir loop on purpose: it runs as `python -I -S`, outliving
# its trainer, and must not import posttrain (or torch) to do it.
_REAPER = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
prefix, parents = sys.argv[1], sys.argv[2:]
while sys.stdin.buffer.read(65536):
    pass
end = time.monotonic() + 10
for parent in parents:
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        continue
    for name in names:
        folder = os.path.join(parent, name)
        while True:
            try:
                pids = open(os.path.join(folder, "cgroup.procs")).read().split()
                for pid in pids:
                    if int(pid) > 0:
                        os.kill(int(pid), signal.SIGKILL)
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > end:
                    break
                time.sleep(0.01)
"""


@dataclass(frozen=True)
class Layout:
    """Where sandbox cgroups are made: controller -> parent folder (v2: one folder for both);
    `swap`: whether a group's swap can be limited (False: swap accounting is off)."""

    version: int
    parents: dict[str, Path]
    swap: bool = True


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root within the hierarchy, fs type, super options) of every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], fields[3], tail[0], set(tail[2].split(",")) if len(tail) > 2 else set()))
    return out


def _own_paths() -> dict[str, str]:
    """The trainer's cgroup per hierarchy: 'v2' for the unified one, else each controller."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in (controllers.split(",") if controllers else ["v2"]):
            out[name] = path
    return out


def _folder(mount: str, root: str, path: str) -> Path | None:
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    rel = path[len(root):] if root != "/" else path
    return Path(mount) / rel.lstrip("/")


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _v2_parent(own: Path, top: Path) -> tuple[Path | None, str]:
    """The folder to make sandbox cgroups in, under a v2 mount at `top`, or (None, why not)."""
    if "memory" in _words(own / "cgroup.subtree_control"):
        return own, ""   # (the root cgroup: the only one holding processes that can do this)
    if "memory" not in _words(own / "cgroup.controllers"):
        return None, f"cgroup v2: the memory controller is not enabled for {own}"
    if own == top:
        return None, (f"cgroup v2: the trainer is in the top cgroup this machine shows ({own}), "
                      "whose children do not get the memory controller (a private cgroup "
                      "namespace's top holds processes, so it cannot give it) and which has no "
                      "parent in reach")
    limit = " ".join(_words(own / "memory.max"))
    if limit != "max":
        return None, (f"cgroup v2: the trainer's cgroup {own} has a memory limit (memory.max "
                      f"{limit or '?'}) that sandbox cgroups beside it would escape")
    if not _writable(own.parent):
        return None, f"cgroup v2: the trainer's parent cgroup {own.parent} is not writable"
    return own.parent, ""


def find_layout() -> tuple[Layout | None, str]:
    """The layout this machine allows, or (None, why not)."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        return None, f"cannot read /proc/self: {e}"
    why = ""
    for point, root, kind, _ in mounts:
        if kind == "cgroup2" and "v2" in own:
            folder = _folder(point, root, own["v2"])
            parent, why = _v2_parent(folder, Path(point)) if folder else (None, "")
            if parent is not None:
                return Layout(2, {"memory": parent, "pids": parent}), ""
    parents = {}
    for point, root, kind, options in mounts:
        for name in ("memory", "pids"):
            if kind == "cgroup" and name in options and name in own:
                folder = _folder(point, root, own[name])
                if folder is not None and folder.is_dir():
                    parents[name] = folder
    if "memory" in parents:
        return Layout(1, parents), ""
    return None, why or "no cgroup hierarchy with the memory controller for the trainer's cgroup"


@functools.cache
def layout() -> tuple[Layout | None, str]:
    """The layout, tried once per process by making and removing a cgroup: (None, why) where
    none can be made (not root, a read-only /sys/fs/cgroup). Leftovers of trainers that are
    gone are removed on the way (`_sweep`)."""
    found, why = find_layout()
    if found is None:
        return None, why
    _sweep(found)
    try:
        group = Group.make(found, 64, 8)
    except OSError as e:
        return None, f"{e.strerror or e} ({e.filename or 'cgroup'})"
    try:   # (a cgroup one may make but not move a process into is no use)
        subprocess.run([shutil.which("true") or sys.executable, "-c", ""], preexec_fn=group.join,
                       check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"a process cannot join a cgroup made here ({e})"
    finally:
        group.remove()
    return dataclasses.replace(found, swap=not set(_SWAP_FILES) & set(group.absent)), ""


def problem() -> str | None:
    """Why no sandbox gets a memory cgroup here (None: each one does). POSTTRAIN_FORCE_NO_CGROUP=1
    answers as a machine without one would (tests of the syscall-filter bound)."""
    if os.environ.get("POSTTRAIN_FORCE_NO_CGROUP") == "1":
        return "POSTTRAIN_FORCE_NO_CGROUP=1"
    if _broken:
        return _broken[0]
    found, why = layout()
    return None if found is not None else why


def _start_time(pid: str) -> str | None:
    """A process's start time after boot in clock ticks (/proc/PID/stat, field 22), None where
    there is no such process: with the pid it names one process for the machine's uptime."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _own_prefix() -> str:
    return f"{_PREFIX}{os.getpid()}-{_start_time('self')}-"


def _new_name() -> str:
    return f"{_own_prefix()}{int(time.time())}-{secrets.token_hex(4)}"


def _start_reaper(found: Layout) -> None:
    """Once per process, before its first group: a small process (the interpreter with no
    imports, detached, its own session) that removes this process's groups when it ends, so a
    trainer killed with SIGKILL leaves no cgroup behind; its sandboxes die with it (bwrap's
    --die-with-parent, the fallback's parent-death signal) and the reaper kills any stragglers."""
    with _reaper_lock:
        if not (_reaper_for and _reaper_for[-1] == os.getpid()):
            _reaper_fds.append(_launch_reaper(found))
            _reaper_for.append(os.getpid())


def _launch_reaper(found: Layout) -> int:
    """Start the reaper; this side of its pipe (held open until this process ends)."""
    read_end, write_end = os.pipe()   # (the write end is this process's alone: not inherited)
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", _REAPER, _own_prefix(),
                        *sorted({str(p) for p in found.parents.values()})],
                       stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       start_new_session=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        os.close(write_end)
        raise OSError(f"the process that removes its cgroups after it could not start ({e})") from e
    finally:
        os.close(read_end)
    return write_end


def _stale(entry: Path, now: float) -> bool:
    """A group whose maker is gone: no process runs with its pid and start time, it holds no
    process, and it is over a minute old (a trainer in another PID namespace, whose pid means
    nothing here, may have just made it)."""
    parts = entry.name[len(_PREFIX):].split("-")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        return False
    return (_start_time(parts[0]) != parts[1] and now - int(parts[2]) > _FRESH_S
            and not _words(entry / "cgroup.procs"))


def _sweep(found: Layout) -> None:
    now = time.time()
    for parent in set(found.parents.values()):
        try:
            entries = list(parent.glob(_PREFIX + "*"))
        except OSError:
            continue
        for entry in entries:
            if _stale(entry, now):
                try:
                    entry.rmdir()
                except OSError:
                    pass


@dataclass
class Group:
    """One sandbox's cgroup (one folder per hierarchy). The child joins it between fork and
    exec (`join`, on descriptors opened here), so everything it starts is inside from the start.
    `absent`: the limit files this kernel does not have (the swap limit where swap accounting
    is off)."""

    version: int
    folders: list[Path]
    fds: list[int]
    absent: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def make(cls, found: Layout, memory_mb: int, max_procs: int) -> Group:
        _start_reaper(found)
        name = _new_name()
        group = cls(found.version, [], [])
        try:
            for folder in dict.fromkeys(p / name for p in found.parents.values()):
                folder.mkdir()
                group.folders.append(folder)
            group._limit(memory_mb << 20, max_procs)
            for folder in group.folders:
                group.fds.append(os.open(folder / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            group.remove()
            raise
        return group

    def _limit(self, memory: int, max_procs: int) -> None:
        if self.version == 2:
            rows = [("memory.max", memory), ("memory.swap.max", 0), ("pids.max", max_procs)]
        else:   # (v1: memsw, memory and swap together, may only be set after the memory limit)
            rows = [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory),
                    ("pids.max", max_procs)]
        for file, value in rows:
            found = [f / file for f in self.folders if (f / file).exists()]
            for path in found:
                path.write_text(str(value))
            if not found and (file != "pids.max" or self.version == 2):
                self.absent.append(file)

    def join(self) -> None:
        """In the child, before it executes: move it into the group (no allocation: a write of
        one byte on an open descriptor)."""
        for fd in self.fds:
            os.write(fd, b"0")

    def oom_kills(self) -> int:
        """Processes the kernel killed in the group for passing its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for folder in self.folders:
            try:
                for line in (folder / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                continue
        return 0

    def remove(self) -> None:
        """Kill whatever is still inside (a grandchild that left the process tree) and remove
        the folders; one that stays busy for 2 s is left for the next trainer's sweep."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        end = time.monotonic() + 2.0
        for folder in reversed(self.folders):
            if (folder / "cgroup.kill").exists():   # (v2: the kernel kills all of it at once)
                try:
                    (folder / "cgroup.kill").write_text("1")
                except OSError:
                    pass
            while True:
                for pid in _words(folder / "cgroup.procs"):
                    if pid.isdigit() and int(pid) > 0:   # (0: out of our PID namespace; kill(0)
                        try:                              # would be our own process group)
                            os.kill(int(pid), signal.SIGKILL)
                        except OSError:
                            pass
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        break
                    time.sleep(0.001)
        self.folders = []


def make_group(memory_mb: int, max_procs: int) -> Group | None:
    """A cgroup for one sandbox; None where `problem()` says none can be made, or where making
    this one fails (then, for the rest of the process, `problem()` says why and none is tried:
    the sandbox runs on its other layers, never fails for want of a cgroup)."""
    if problem() is not None:
        return None
    found, _ = layout()
    try:
        return Group.make(found, memory_mb, max_procs)
    except OSError as e:
        parents = sorted({str(p) for p in found.parents.values()})
        _broken.append(f"making a cgroup in {', '.join(parents)} failed: {e.strerror or e}")
        return None
