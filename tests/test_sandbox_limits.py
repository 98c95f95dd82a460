"""Red team, the sandbox's limits as a whole: memory held outside any process (memfd files, SysV
shared memory, socket and pipe buffers), open files, processes as root, and the syscall filter
compared with maintained profiles (docs/safety.md). Every program runs through the python tool,
as the model's would; the bwrap cases need bubblewrap as tests/test_sandbox.py's do."""

import errno
import os
import struct
import subprocess
import sys
import time

import pytest

from posttrain.envs.tools import run_python
from posttrain.sandbox import seccomp
from tests.test_sandbox import MODES, _mode

MEMFD_2GB = """
import os
held = 0
try:
    for i in range(128):                    # 16 MB each: under the 16 MB file-size limit
        fd = os.memfd_create("x%d" % i)
        os.posix_fallocate(fd, 0, 16 << 20)
        held += 16
    print("held", held, "MB")
except OSError as e:
    print("refused", errno.errorcode[e.errno], "after", held, "MB")
""".replace("import os", "import errno, os")

SYSV_2GB = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes, libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
held = 0
for i in range(16):                         # 128 MB each, attached and filled: held
    sid = libc.shmget(0, 128 << 20, 0o1600)
    if sid < 0:
        print("refused errno", ctypes.get_errno())
        break
    addr = libc.shmat(sid, None, 0)
    libc.shmctl(sid, 0, None)               # IPC_RMID at once: gone when this process is
    if addr in (None, ctypes.c_void_p(-1).value):
        print("shmat refused errno", ctypes.get_errno())
        break
    ctypes.memset(addr, 1, 128 << 20)
    held += 128
else:
    print("held", held, "MB")
"""


@pytest.mark.parametrize("mode", MODES)
def test_two_gb_in_memfd_files_under_a_512_mb_limit_is_refused(mode):
    """memfd files live outside every address space, so neither the per-process limit nor the
    PSS check sees them: the syscall filter refuses memfd_create (and where the machine allows
    a memory cgroup, it would kill the holder too). The trainer (this process) goes on."""
    out = run_python(MEMFD_2GB, mode=_mode(mode), timeout_s=10.0, memory_mb=512)
    assert "held 2048 MB" not in out, out
    assert "refused EPERM after 0 MB" in out or "more than 512 MB" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_two_gb_of_sysv_shared_memory_under_a_512_mb_limit_is_refused(mode):
    """shmget is refused by the filter. Each segment is marked for removal as soon as it is
    attached, so a filter that let it through could not leave segments on the machine (the
    fallback shares the machine's SysV namespace)."""
    out = run_python(SYSV_2GB, mode=_mode(mode), timeout_s=10.0, memory_mb=512)
    assert "held 2048 MB" not in out, out
    if seccomp.filter_program() is not None:
        assert f"refused errno {errno.EPERM}" in out, out


@pytest.mark.parametrize("mode", MODES)
def test_open_files_are_bounded(mode):
    """Each pipe or socket holds kernel buffers no PSS counts: their number is capped."""
    code = ("import os\nn = 0\ntry:\n    while n < 10000:\n        os.pipe()\n        n += 2\n"
            "except OSError as e:\n    print(e.strerror)\nprint('open', n)")
    out = run_python(code, mode=_mode(mode), timeout_s=10.0)
    assert "Too many open files" in out and int(out.split("open")[-1]) < 64, out


# --- the syscall filter, live --------------------------------------------------------------------

PROBE = """
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    r = libc.syscall(*[ctypes.c_long(a) for a in args])
    print(name, errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "allowed")
N = NUMBERS
call("beyond", 1000)
call("pidfd_getfd", N["pidfd_getfd"], 0, 0, 0)
call("process_madvise", N["process_madvise"], 0, 0, 0, 0, 0)
call("open_tree_attr", N["open_tree_attr"], 0, 0, 0, 0, 0)
call("quotactl_fd", N["quotactl_fd"], 0, 0, 0, 0)
call("mbind", N["mbind"], 0, 0, 0, 0, 0, 0)
call("set_mempolicy", N["set_mempolicy"], 0, 0, 0)
call("migrate_pages", N["migrate_pages"], 0, 0, 0, 0)
call("move_pages", N["move_pages"], 0, 0, 0, 0, 0, 0)
call("personality_no_aslr", N["personality"], 0x0040000)
call("personality_query", N["personality"], 0xFFFFFFFF)
for fam in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_UNIX"):
    try:
        socket.socket(getattr(socket, fam), socket.SOCK_RAW if fam == "AF_PACKET" else socket.SOCK_DGRAM)
        print(fam, "allowed")
    except OSError as e:
        print(fam, errno.errorcode[e.errno])
a, b = socket.socketpair()
try:
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    print("sndbuf allowed")
except OSError as e:
    print("sndbuf", errno.errorcode[e.errno])
"""


# the kernel's numbers (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h),
# written here rather than read from the filter's own table
NUMBERS = {
    "x86_64": dict(pidfd_getfd=438, process_madvise=440, open_tree_attr=467, quotactl_fd=443,
                   mbind=237, set_mempolicy=238, migrate_pages=256, move_pages=279, personality=135,
                   clone=56),
    "aarch64": dict(pidfd_getfd=438, process_madvise=440, open_tree_attr=467, quotactl_fd=443,
                    mbind=235, set_mempolicy=237, migrate_pages=238, move_pages=239, personality=92,
                    clone=220)}


def _numbers() -> dict[str, int]:
    machine = os.uname().machine.lower()
    if machine not in NUMBERS:
        pytest.skip(f"no seccomp filter for {machine}")
    return NUMBERS[machine]


@pytest.mark.parametrize("mode", MODES)
def test_the_filter_refuses_what_moby_and_flatpak_refuse(mode):
    """Through ctypes' syscall() inside the sandbox: a number beyond the table, stealing a file
    descriptor, another process's memory advice, the new mount calls, NUMA placement, a
    personality that turns off address randomisation, every socket family but AF_UNIX, bigger
    socket buffers. The personality query and AF_UNIX still work."""
    out = run_python(PROBE.replace("NUMBERS", repr(_numbers())), mode=_mode(mode), timeout_s=10.0)
    got = dict(line.split(None, 1) for line in out.strip().splitlines())
    assert got.pop("beyond") == "ENOSYS" and got.pop("personality_query") == "allowed", out
    assert got.pop("AF_UNIX") == "allowed", out
    assert all(got.pop(f) == "EAFNOSUPPORT" for f in ("AF_INET", "AF_INET6", "AF_NETLINK",
                                                       "AF_PACKET")), out
    assert got == dict.fromkeys(got, "EPERM") and len(got) == 10, out


def test_every_number_above_the_table_is_refused_live(monkeypatch):
    """With the filter's table cut at 331, statx (332) is refused with ENOSYS inside the
    sandbox (libc falls back to the older call), while it works outside: a syscall newer than
    the filter is never allowed by default."""
    numbers = _numbers()
    if numbers["clone"] != 56:
        pytest.skip("the live check uses x86-64's statx number")
    code = ("import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "buf = ctypes.create_string_buffer(256)\n"
            "r = libc.syscall(332, -100, b'/', 0, 0x7ff, buf)\n"
            "print('statx', 'ok' if r == 0 else errno.errorcode[ctypes.get_errno()])")
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert outside.stdout.strip() == "statx ok"
    monkeypatch.setattr(seccomp, "LAST_KNOWN", 331)
    assert run_python(code, mode="fallback", timeout_s=10.0).strip() == "statx ENOSYS"


# --- the filter, instruction by instruction on both architectures --------------------------------

def run_filter(program: bytes, arch: int, nr: int, args=(0,) * 6) -> tuple[str, int]:
    """A classic-BPF interpreter for the instructions the filter uses: (verdict, errno)."""
    data = struct.pack("=iI", nr, arch) + b"\0" * 8 + struct.pack("=6Q", *args)
    rows = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = rows[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:
            action = k & 0xFFFF0000
            return {0x7FFF0000: "allow", 0x00050000: "errno", 0x80000000: "kill"}[action], k & 0xFFFF
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_program_on_both_architectures(machine):
    audit, nr = seccomp.ARCHES[machine]
    program = seccomp.filter_program(machine)
    verdict = lambda n, *a: run_filter(program, audit, n, a + (0,) * (6 - len(a)))   # noqa: E731
    eperm, enosys = ("errno", errno.EPERM), ("errno", errno.ENOSYS)
    assert verdict(471) == enosys and verdict(1000) == enosys     # (the table ends at 470, listns)
    for name in ("pidfd_getfd", "process_madvise", "open_tree_attr", "quotactl_fd", "mbind",
                 "set_mempolicy", "get_mempolicy", "migrate_pages", "move_pages", "memfd_create",
                 "shmget", "msgget", "semget", "mq_open", "process_mrelease", "memfd_secret"):
        assert verdict(nr[name]) == eperm, name
    for family, want in ((1, ("allow", 0)), (2, ("errno", errno.EAFNOSUPPORT)),
                         (10, ("errno", errno.EAFNOSUPPORT)), (16, ("errno", errno.EAFNOSUPPORT)),
                         (17, ("errno", errno.EAFNOSUPPORT))):
        assert verdict(nr["socket"], family) == want and verdict(nr["socketpair"], family) == want
    assert [verdict(nr["personality"], p)[0] for p in (0, 8, 0x20000, 0xFFFFFFFF)] == ["allow"] * 4
    assert verdict(nr["personality"], 0x0040000) == eperm            # ADDR_NO_RANDOMIZE
    assert verdict(nr["ioctl"], 0, 0x5412) == eperm and verdict(nr["ioctl"], 0, 0x5401)[0] == "allow"
    assert verdict(nr["setsockopt"], 3, 1, 7) == eperm and verdict(nr["setsockopt"], 3, 1, 2)[0] == "allow"
    assert verdict(nr["clone"], 0x10000000) == eperm and verdict(nr["clone"], 0x11)[0] == "allow"
    assert verdict(nr["clone3"]) == enosys and verdict(0)[0] == "allow"   # read
    assert run_filter(program, 0x40000003, 0)[0] == "kill"                 # another ABI (i386)


# --- memory and processes as a whole: a cgroup per sandbox where the machine allows ---------------

@pytest.fixture
def group_layout():
    from posttrain.sandbox import cgroup
    why = cgroup.problem()
    if why is not None:
        pytest.skip(f"no memory cgroup can be made here ({why}): the syscall filter and the "
                    "open-file limit are the bound, tested above")
    return cgroup.layout()[0]


def test_a_sandbox_cgroup_kills_memory_held_outside_its_processes(group_layout):
    """Without the filter (a plain child in a 256 MB cgroup), memfd files past the limit are
    killed by the kernel inside the cgroup; the cgroup is gone afterwards."""
    from posttrain.sandbox import cgroup
    group = cgroup.Group.make(group_layout, 256, 16)
    code = MEMFD_2GB.replace("except OSError", "except ImportError")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], preexec_fn=group.join, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == -9 and "held 2048" not in res.stdout and time.monotonic() - t0 < 10
    assert group.oom_kills() >= 1
    folders = list(group.folders)
    group.remove()
    assert not any(f.exists() for f in folders)


@pytest.mark.skipif(os.geteuid() != 0, reason="the process limit is the kernel's for a normal user")
def test_forks_stop_at_the_process_limit_in_the_fallback_as_root(group_layout):
    """RLIMIT_NPROC never applies to root: in the fallback as root only the cgroup's pids.max
    stops a program that forks (before it, the wall clock did)."""
    if "pids" not in group_layout.parents:
        pytest.skip("no pids controller here")
    code = ("import os, time\nn = 0\nfor i in range(60):\n    try: pid = os.fork()\n"
            "    except OSError: break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
            "    n += 1\nprint('forked', n)")
    out = run_python(code, mode="fallback", timeout_s=10.0, max_procs=12)
    assert 0 < int(out.split("forked")[1].split()[0]) < 17, out


@pytest.fixture
def warnings_once(caplog):
    """The once-per-process warnings, fresh for this test and after it."""
    from posttrain.sandbox import launch
    launch._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        yield lambda: [r.getMessage() for r in caplog.records if "SANDBOX" in r.getMessage()]
    launch._warn_once.cache_clear()


@pytest.mark.parametrize("has_filter", [True, False])
def test_a_machine_without_a_memory_cgroup_says_so_once(monkeypatch, warnings_once, has_filter):
    """One line, however many sandboxes: why, what is refused (only where this architecture
    has a syscall filter), and that the fallback's /tmp and /dev/shm are the machine's."""
    from posttrain.sandbox import launch
    monkeypatch.setenv("POSTTRAIN_FORCE_NO_CGROUP", "1")
    if not has_filter:
        monkeypatch.setattr(seccomp, "filter_program", lambda machine=None: None)
    for _ in range(3):
        launch.decide("fallback", "the python tool", "env.sandbox")
    lines = warnings_once()
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "POSTTRAIN_FORCE_NO_CGROUP=1" in lines[0] and "memfd" in lines[0]
    assert ("refused by the syscall filter" in lines[0]) == has_filter, lines[0]
    assert ("no syscall filter" in lines[0]) != has_filter, lines[0]
    assert "/dev/shm, 16 MB a file, any number of files" in lines[0], lines[0]


def test_a_cgroup_without_a_swap_limit_says_so_at_start(monkeypatch, warnings_once, tmp_path):
    """Swap accounting off: the limit files are missing, which the group notes and the start
    line says (what the sandbox holds in shared memory can go to swap)."""
    from posttrain.sandbox import cgroup, launch
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text("0")
    group = cgroup.Group(1, [folder], [])
    group._limit(64 << 20, 8)
    assert group.absent == ["memory.memsw.limit_in_bytes"]
    assert (folder / "memory.limit_in_bytes").read_text() == str(64 << 20)
    monkeypatch.delenv("POSTTRAIN_FORCE_NO_CGROUP", raising=False)
    monkeypatch.setattr(cgroup, "_broken", [])
    monkeypatch.setattr(cgroup, "layout", lambda: (cgroup.Layout(1, {"memory": tmp_path},
                                                                 swap=False), ""))
    launch.decide("fallback", "the python tool", "env.sandbox")
    lines = warnings_once()
    assert len(lines) == 1 and "swap cannot be limited" in lines[0], lines


def test_a_cgroup_that_cannot_be_made_is_no_bubblewrap_problem(monkeypatch, warnings_once,
                                                               tmp_path):
    """Making the group fails (here: a name taken): bubblewrap's own check makes no cgroup and
    still passes, the program runs without one (no host path in its output), and the start
    line says why once; no other group is tried."""
    from posttrain.sandbox import cgroup, launch
    tries = []

    def taken(found, memory_mb, max_procs):
        tries.append(memory_mb)
        raise FileExistsError(17, "File exists", "/sys/fs/cgroup/memory/posttrain-1-2")
    monkeypatch.delenv("POSTTRAIN_FORCE_NO_CGROUP", raising=False)
    monkeypatch.setattr(cgroup, "_broken", [])
    monkeypatch.setattr(cgroup, "layout", lambda: (cgroup.Layout(1, {"memory": tmp_path}), ""))
    monkeypatch.setattr(cgroup.Group, "make", taken)
    launch.bwrap_problem.cache_clear()
    try:
        modes = ["bwrap", "fallback"] if launch.bwrap_problem() is None else ["fallback"]
        assert tries == [], "bwrap_problem made a cgroup"
        for mode in modes * 2:
            out = run_python("print(6*7)", mode=mode, timeout_s=10.0)
            assert out.strip() == "42" and "posttrain-1-2" not in out, out
    finally:
        launch.bwrap_problem.cache_clear()
    assert len(tries) == 1 and "File exists" in cgroup.problem()
    lines = warnings_once()
    assert len(lines) == 1 and f"making a cgroup in {tmp_path} failed: File exists" in lines[0]


def test_a_failed_open_closes_the_descriptors_already_open(tmp_path, monkeypatch):
    """Two hierarchies (v1 memory and pids): the second cgroup.procs cannot be opened; the
    first descriptor is closed and both folders removed."""
    from posttrain.sandbox import cgroup
    real_open, opened = os.open, []

    def second_fails(path, flags, *args):
        if opened:
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        opened.append(real_open(os.devnull, os.O_WRONLY))
        return opened[-1]
    parents = {"memory": tmp_path / "memory", "pids": tmp_path / "pids"}
    for p in parents.values():
        p.mkdir()
    monkeypatch.setattr(cgroup.os, "open", second_fails)
    with pytest.raises(OSError, match="Too many open files"):
        cgroup.Group.make(cgroup.Layout(1, parents), 64, 8)
    monkeypatch.undo()
    with pytest.raises(OSError) as closed:
        os.fstat(opened[0])
    assert closed.value.errno == errno.EBADF
    assert not any(any(p.iterdir()) for p in parents.values())


def test_the_sweep_removes_only_groups_whose_trainer_is_gone(tmp_path, monkeypatch):
    """Names hold the maker's pid and start time, when it was made, and a random part. Swept: a
    dead trainer's (our pid, another start time: the pid was reused) and a long-gone one's.
    Kept: ours, one made seconds ago by a pid we cannot see (another PID namespace), one that
    holds a process, and anything not named like a group."""
    from pathlib import Path
    from posttrain.sandbox import cgroup
    pid, start, now = os.getpid(), int(cgroup._start_time("self")), int(time.time())
    names = {"reused pid": f"posttrain-{pid}-{start + 1}-{now - 3600}-aa",
             "gone": f"posttrain-999999999-5-{now - 3600}-bb",
             "ours": f"posttrain-{pid}-{start}-{now - 3600}-cc",
             "just made": f"posttrain-999999999-5-{now - 5}-dd",
             "busy": f"posttrain-999999999-5-{now - 3600}-ee",
             "other": "posttrain-junk", "old style": f"posttrain-{pid}-3"}
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / names["busy"] / "cgroup.procs").write_text("4242\n")
    real_rmdir, tried = Path.rmdir, []
    monkeypatch.setattr(Path, "rmdir", lambda self: (tried.append(self.name), real_rmdir(self)))
    cgroup._sweep(cgroup.Layout(1, {"memory": tmp_path}))
    assert sorted(tried) == sorted([names["reused pid"], names["gone"]])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == set(names.values()) - {names["reused pid"], names["gone"]}


def test_a_dead_trainers_groups_under_our_pid_never_block_ours(group_layout):
    """A trainer that crashed with this process's pid (common in containers) left groups under
    every small number: new groups are still made (a fresh random part), never taken from it."""
    from posttrain.sandbox import cgroup
    parent = group_layout.parents["memory"]
    leftovers = [parent / f"posttrain-{os.getpid()}-{n}" for n in range(40)]
    try:
        for folder in leftovers:
            folder.mkdir()
        groups = [cgroup.Group.make(group_layout, 64, 8) for _ in range(3)]
        names = {g.folders[0].name for g in groups}
        for g in groups:
            g.remove()
        assert len(names) == 3 and not names & {f.name for f in leftovers}
        assert all(n.startswith(f"posttrain-{os.getpid()}-{cgroup._start_time('self')}-")
                   for n in names)
    finally:
        for folder in leftovers:
            if folder.exists():
                folder.rmdir()


def test_a_trainer_killed_with_sigkill_leaves_no_cgroup(group_layout):
    """A trainer that makes a group, starts a process in it and is killed with SIGKILL (no
    cleanup of its own runs): the group's process is killed and the group removed within
    seconds, by the small process every trainer starts before its first group."""
    code = ("import os, signal, subprocess\nfrom posttrain.sandbox import cgroup\n"
            "g = cgroup.make_group(64, 8)\n"
            "p = subprocess.Popen(['sleep', '61.9'], preexec_fn=g.join, start_new_session=True,\n"
            "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(p.pid, *g.folders, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    sleeper, *folders = res.stdout.split()
    end = time.monotonic() + 10
    while any(os.path.exists(f) for f in folders) and time.monotonic() < end:
        time.sleep(0.05)
    left = [f for f in folders if os.path.exists(f)]
    if left:   # (the test leaves nothing either)
        os.kill(int(sleeper), 9)
        time.sleep(0.2)
        for f in left:
            os.rmdir(f)
    assert len(folders) == len(group_layout.parents) and not left, left


def test_a_reward_call_killed_for_memory_is_reported_as_the_memory_limit(monkeypatch):
    """The kernel killed a call in the reward sandbox's cgroup (its oom_kill count rose during the
    batch): the crash is reported as the memory limit; a crash with no kill stays a crash."""
    import itertools
    from posttrain.rewards.pool import RewardPool
    from posttrain.sandbox import launch
    pool = RewardPool(("tests.toy_rewards:dies", "tests.toy_rewards:always_one"), 1, 10.0,
                      "fallback", memory_mb=1024)
    kw = {"prompt": "q", "completion": "a", "answer": "1"}
    calls = [("function", "tests.toy_rewards:dies", kw), ("function", "tests.toy_rewards:always_one", kw)]
    try:
        monkeypatch.setattr(launch.Spawned, "oom_kills", lambda self: 0)
        assert [o.status for o in pool.map(calls)] == ["crash", "ok"]
        kills = itertools.count()
        monkeypatch.setattr(launch.Spawned, "oom_kills", lambda self: next(kills))
        out = pool.map(calls)
        assert [o.status for o in out] == ["memory_limit", "ok"]
        assert "reward.memory_mb (1024 MB)" in out[0].error
    finally:
        pool.close()


@pytest.mark.parametrize("case", ["the root cgroup", "an unlimited unit", "a unit under a limit",
                                  "a parent we cannot write", "a private namespace's top",
                                  "no memory controller"])
def test_where_cgroup_v2_sandboxes_are_made(case, tmp_path, monkeypatch):
    """cgroup v2 (not on every test machine, so on folders shaped like one), in states the kernel
    allows: below the root cgroup (the only one holding processes that may give children the
    memory controller); beside an unlimited cgroup whose parent gives children the memory
    controller and is writable; nowhere where that would escape the trainer's memory limit, the
    parent is closed, or the trainer is in a private namespace's top. The trainer never moves."""
    from posttrain.sandbox import cgroup
    parent = tmp_path / "job.slice"
    own = tmp_path if case == "the root cgroup" else (
        parent if case == "a private namespace's top" else parent / "trainer.scope")
    own.mkdir(parents=True, exist_ok=True)
    (own / "cgroup.procs").write_text(f"{os.getpid()}\n")
    (own / "cgroup.subtree_control").write_text("memory pids" if own == tmp_path else "")
    (own / "cgroup.controllers").write_text("cpu" if case == "no memory controller" else
                                            "cpu memory pids")
    if own != tmp_path:   # (the root has no memory.max)
        (own / "memory.max").write_text("8589934592\n" if case == "a unit under a limit" else "max\n")
    if own not in (tmp_path, top := parent if case == "a private namespace's top" else tmp_path):
        (own.parent / "cgroup.procs").write_text("")   # (a top's parent is outside the mount)
    monkeypatch.setattr(cgroup, "_writable", lambda p: case != "a parent we cannot write")
    monkeypatch.setattr(cgroup, "_mounts", lambda: [(str(top), "/", "cgroup2", set())])
    monkeypatch.setattr(cgroup, "_own_paths",
                        lambda: {"v2": "/" + str(own.relative_to(top)).strip(".")})
    found, why = cgroup.find_layout()
    want = {"the root cgroup": own, "an unlimited unit": parent}.get(case)
    assert (found and found.parents["memory"]) == want and (found is None) == bool(why)
    if case == "a unit under a limit":
        assert "memory.max 8589934592" in why and "escape" in why
    assert (own / "cgroup.procs").read_text() == f"{os.getpid()}\n"
