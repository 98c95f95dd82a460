"""Red team, tools side: programs a policy may hand to the python tool, each trying to reach the
trainer, its secrets, its run folder, the network or the machine. In the 'bwrap' mode every one is
contained; the 'fallback' mode (no bubblewrap) is tested for what it promises (docs/safety.md).

bubblewrap is part of the install for CI (.ci/run installs it). Where it cannot run, the bwrap
tests fail and say why, unless POSTTRAIN_ALLOW_NO_SANDBOX=1 is set, in which case they are
skipped with that reason and the fallback's tests still run: never a silent skip."""

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from posttrain.envs.builtin import ToolEnv
from posttrain.sandbox.launch import Limits, bwrap_works
from posttrain.sandbox.run import run_python_code
from posttrain.envs.tools import make_tools, run_python

SECRET = "hunter2-posttrain-secret"
MODES = ["bwrap", "fallback"]


@pytest.fixture
def bwrap():
    if not bwrap_works():
        reason = ("bubblewrap cannot start a sandbox on this machine (apt-get install bubblewrap; "
                  "user namespaces, or root)")
        if os.environ.get("POSTTRAIN_ALLOW_NO_SANDBOX") == "1":
            pytest.skip(reason + "; POSTTRAIN_ALLOW_NO_SANDBOX=1: the fallback's tests run instead")
        pytest.fail(reason + "; set POSTTRAIN_ALLOW_NO_SANDBOX=1 to test only the fallback")
    return "bwrap"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", SECRET)


@pytest.fixture
def run_folder(tmp_path):
    run = tmp_path / "runs" / "grpo-1"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "answers.jsonl").write_text(f'{{"answer": "{SECRET}"}}\n')
    (run / "checkpoints" / "step_000001" / "trainer_state.pt").write_text("good")
    return run


def tool(code: str, mode: str, **kw) -> str:
    return run_python(code, mode=mode, **{"timeout_s": 3.0, **kw})


def sleeping(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except OSError:
            pass
    return out


def rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


# --- what bwrap contains -------------------------------------------------------------------------

TRAINER = """
import os, subprocess, sys
code = sys.argv[1].replace("TRAINER_PID", str(os.getpid()))
if sys.argv[2] == "unsandboxed":   # the control: a plain child of the trainer
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
else:
    from posttrain.envs.tools import run_python
    out = run_python(code, mode=sys.argv[2], timeout_s=5.0)
print("OUT:" + out)
print("TRAINER ALIVE")
"""


def as_trainer(code: str, mode: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` through the python tool from a separate trainer process (started with `env`,
    so its /proc/PID/environ holds it from its first instruction; TRAINER_PID in the code is its
    pid), so that a program that signals its parent cannot take the test runner with it."""
    return subprocess.run([sys.executable, "-c", TRAINER, code, mode], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})},
                          cwd=str(Path(__file__).resolve().parent.parent))


READ_ENVIRON = ("import os\nfor p in ('/proc/TRAINER_PID/environ', '/proc/%d/environ' % os.getppid(), "
                "'/proc/self/environ'):\n"
                "    try: print(open(p).read())\n    except OSError as e: print(type(e).__name__)\n"
                "print(os.environ)")


def test_the_trainers_environment_is_out_of_reach(bwrap):
    """A secret in the trainer's environment from its start: the program reads the trainer's
    environ by pid, its parent's, its own and os.environ, and finds none of it. The same program
    run as a plain child of the trainer does (the check is live)."""
    res = as_trainer(READ_ENVIRON, "bwrap", {"POSTTRAIN_TEST_SECRET": SECRET})
    assert res.returncode == 0 and "TRAINER ALIVE" in res.stdout, res.stderr
    assert SECRET not in res.stdout and "FileNotFoundError" in res.stdout
    control = as_trainer(READ_ENVIRON, "unsandboxed", {"POSTTRAIN_TEST_SECRET": SECRET})
    assert control.stdout.count(SECRET) >= 3


def test_a_program_that_kills_its_parent_leaves_the_trainer_alive(bwrap):
    res = as_trainer("import os, signal\nfor pid in (os.getppid(), TRAINER_PID, -1):\n"
                     "    try: os.kill(pid, signal.SIGKILL); print('sent to', pid)\n"
                     "    except OSError as e: print(type(e).__name__)", "bwrap")
    assert res.returncode == 0 and "TRAINER ALIVE" in res.stdout, res.stderr
    # its parent is bubblewrap's own (refused as root; as a user, killed: the sandbox ends), the
    # trainer's pid is not in its namespace, kill(-1) finds nothing outside it
    lines = res.stdout.split("OUT:")[1].split("\n")
    assert lines[1:3] == ["ProcessLookupError", "ProcessLookupError"] or (
        not os.geteuid() and "sent to" in lines[0]), res.stdout


def test_the_run_folder_home_and_etc_are_invisible(bwrap, run_folder):
    """Only the path down to Python's own install exists of the home folder (bwrap makes the
    mount point); nothing else of it, of /etc or of the run folder."""
    home = Path.home()
    code = (f"import os\nfor p in ({str(run_folder / 'answers.jsonl')!r}, '/etc/passwd', "
            f"{str(run_folder)!r}, {str(home / '.bashrc')!r}):\n    print(p, os.path.exists(p))\n"
            f"try: print(sorted(os.listdir({str(home)!r})))\nexcept OSError: print([])")
    out = tool(code, bwrap)
    listed = ast.literal_eval(out.strip().splitlines()[-1])
    on_path = [part for part in Path(os.path.realpath(__import__("sys").base_prefix)).parts]
    assert SECRET not in out and " True" not in out and out.count(" False") == 4
    assert all(name in on_path for name in listed)


def test_nothing_outside_the_sandbox_can_be_written(bwrap, run_folder):
    state = run_folder / "checkpoints" / "step_000001" / "trainer_state.pt"
    code = (f"for p in ({str(state)!r}, {str(run_folder / 'reward_mod.py')!r}, '/usr/evil'):\n"
            f"    try: open(p, 'w').write('evil'); print('wrote', p)\n"
            f"    except OSError as e: print(type(e).__name__)")
    out = tool(code, bwrap)
    assert "wrote" not in out and state.read_text() == "good"
    assert not (run_folder / "reward_mod.py").exists()


def test_no_network_even_to_loopback(bwrap):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    out = tool(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               f"    print('connected')\nexcept OSError as e: print(type(e).__name__)", bwrap)
    time.sleep(0.2)
    server.close()
    assert "connected" not in out and accepted in ([], [None])


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_forks_stop_at_the_process_limit(bwrap):
    """The program counts the processes it manages to start (each sleeps): the count stops at
    python_max_procs, far below the 60 it tries."""
    code = ("import os, time\nn = 0\nfor i in range(60):\n    try: pid = os.fork()\n"
            "    except OSError: break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n"
            "    n += 1\nprint('forked', n)")
    out = tool(code, bwrap, max_procs=12)
    forked = int(out.split("forked")[1].split()[0])
    assert 0 < forked < 12, out


def test_a_fork_bomb_is_bounded_and_leaves_nothing(bwrap):
    t0 = time.monotonic()
    # every forked copy carries the code, marker included, on its command line (python -c CODE)
    out = tool("import os, time  # forkbomb-5e1d\nwhile True:\n    try: os.fork()\n"
               "    except OSError: time.sleep(0.01)", bwrap, timeout_s=2.0, max_procs=16)
    assert time.monotonic() - t0 < 5 and "timed out" in out
    time.sleep(0.2)
    assert not sleeping("forkbomb-5e1d")


def test_setsid_cannot_outlive_the_call(bwrap):
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '61.7'])\n"
            "print('left a child')")
    assert "left a child" in tool(code, bwrap)
    time.sleep(0.3)
    assert not sleeping("61.7")


def test_signals_to_the_trainer_reach_nothing(bwrap):
    pid = os.getpid()
    code = (f"import os, signal\nfor f in (lambda: os.kill({pid}, signal.SIGSTOP), "
            f"lambda: os.killpg(os.getpgid({pid}), signal.SIGKILL), lambda: os.kill(os.getppid(), "
            f"signal.SIGSTOP), lambda: os.kill(-1, signal.SIGKILL)):\n"
            f"    try: f()\n    except OSError as e: print(type(e).__name__)")
    out = tool(code, bwrap)
    # (a stopped or killed trainer would never get here;) all four attempts failed: the trainer's
    # pid and process group do not exist in the sandbox's pid namespace, its parent (bubblewrap)
    # refuses the signal, and kill(-1) finds nothing else to signal
    assert out.split() == ["ProcessLookupError", "ProcessLookupError", "PermissionError",
                           "ProcessLookupError"], out


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_the_sandbox_tmp_and_shm_are_bounded(bwrap, where):
    """Many small files (each far below the 16 MB file limit) fill the tmpfs: 'No space left'."""
    out = tool(f"for i in range(4096): open('{where}/f%d' % i, 'wb').write(b'x' * (1 << 16))",
               bwrap, tmp_mb=8)
    assert "No space left" in out, out


PTRACE = ("import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "print('ptrace', libc.ptrace(0, 0, None, None), ctypes.get_errno(), flush=True)\nos._exit(0)")
SYSCALLS = ("import ctypes, os, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "try: open('/dev/x', 'w'); print('made /dev/x')\nexcept OSError as e: print(type(e).__name__)\n"
            "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "print('ptrace', libc.ptrace(0, 0, None, None), ctypes.get_errno())\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "pid = os.fork()\nif pid == 0: os._exit(7)\nprint('child', os.waitpid(pid, 0)[1] >> 8)")


@pytest.mark.parametrize("mode", MODES)
def test_new_namespaces_and_ptrace_are_refused_and_dev_is_read_only(mode):
    """The seccomp filter: unshare(CLONE_NEWUSER) and ptrace(PTRACE_TRACEME) get EPERM (without
    the filter the second succeeds, as the control below shows); the program still forks and
    starts threads. In bwrap no file can be made in /dev."""
    out = tool(SYSCALLS, _mode(mode))
    assert "unshare -1 1" in out and "ptrace -1 1" in out, out
    assert "thread" in out and "child 7" in out
    if mode == "bwrap":
        assert "made /dev/x" not in out
    control = subprocess.run([sys.executable, "-I", "-S", "-c", PTRACE], capture_output=True,
                             text=True, timeout=30)   # (traced by its parent: it exits at once)
    assert "ptrace 0 0" in control.stdout, control.stdout


def test_only_the_interpreter_and_its_library_of_the_prefix_are_there(bwrap):
    """Python's prefix minus lib/ and the interpreter (a conda env's conda-meta and etc/ hold its
    settings): nothing else of it is in the sandbox."""
    import sys as host_sys
    prefix = os.path.realpath(host_sys.base_prefix)
    others = sorted(p.name for p in Path(prefix).iterdir() if p.name not in ("lib", "bin"))
    out = tool(f"import os\nprint(sorted(os.listdir({prefix!r})))", bwrap)
    assert ast.literal_eval(out.strip().splitlines()[-1]) in (["bin", "lib"], ["lib"]), (out, others)


# --- what both modes do --------------------------------------------------------------------------



def _mode(name: str) -> str:
    if name == "bwrap" and not bwrap_works():
        if os.environ.get("POSTTRAIN_ALLOW_NO_SANDBOX") == "1":
            pytest.skip("bubblewrap cannot start a sandbox on this machine (apt-get install "
                        "bubblewrap; user namespaces, or root); POSTTRAIN_ALLOW_NO_SANDBOX=1: the "
                        "fallback's tests run instead")
        pytest.fail("bubblewrap cannot start a sandbox here (apt-get install bubblewrap)")
    return name


@pytest.mark.parametrize("mode", MODES)
def test_the_environment_is_stripped(mode, secret_env):
    out = tool("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ').read())", _mode(mode))
    assert SECRET not in out and "POSTTRAIN_TEST_SECRET" not in out


@pytest.mark.parametrize("mode", MODES)
def test_unbounded_output_is_cut_and_costs_the_trainer_nothing(mode):
    before = rss_kb()
    t0 = time.monotonic()
    out = tool("while True: print('x' * 100000)", _mode(mode), max_output=2000)
    assert time.monotonic() - t0 < 3 and len(out) < 2200 and "output cut at 2000 bytes" in out
    assert rss_kb() - before < 20_000                 # kilobytes: the flood was never buffered


@pytest.mark.parametrize("mode", MODES)
def test_stdin_is_empty(mode):
    assert tool("import sys\nprint(repr(sys.stdin.read()))", _mode(mode)).strip() == "''"


@pytest.mark.parametrize("mode", MODES)
def test_loops_memory_and_big_files_hit_their_limits(mode):
    m = _mode(mode)
    assert "timed out" in tool("while True: pass", m, timeout_s=1.0)
    assert "MemoryError" in tool("x = bytearray(2_000_000_000)", m, memory_mb=200)
    assert "File too large" in tool("open('big', 'wb').write(b'x' * (64 << 20))", m)


@pytest.mark.parametrize("mode", MODES)
def test_the_whole_process_group_dies_with_the_call(mode):
    code = "import subprocess\nsubprocess.Popen(['sleep', '61.8'])\nprint('started')"
    assert "started" in tool(code, _mode(mode))
    time.sleep(0.3)
    assert not sleeping("61.8")


def test_auto_is_bwrap_where_bubblewrap_starts_a_sandbox():
    """Decided by starting one (bwrap_problem runs print(6*7) in the real sandbox)."""
    from posttrain.sandbox.launch import bwrap_problem, decide
    assert (decide("auto", "x", "env.sandbox") == "bwrap") == (bwrap_problem() is None)
    assert decide("fallback", "x", "env.sandbox") == "fallback"


@pytest.fixture
def no_bwrap(monkeypatch):
    """A machine where bubblewrap cannot start (a container without user namespaces)."""
    from posttrain.sandbox import launch
    monkeypatch.setenv("POSTTRAIN_FORCE_NO_BWRAP", "1")
    launch.bwrap_problem.cache_clear()
    yield launch
    launch.bwrap_problem.cache_clear()


def test_without_bubblewrap_root_is_refused_and_a_user_is_warned(no_bwrap, monkeypatch, caplog):
    """bwrap named and not there: refused. auto as root: refused. auto as a normal user: only
    scorers that parse and compare fall back, with a warning (what runs the model's code is
    refused: test_without_bubblewrap_auto_refuses_what_runs_the_models_code)."""
    launch = no_bwrap
    with pytest.raises(launch.SandboxError, match="env.sandbox=bwrap but bubblewrap cannot start"):
        launch.decide("bwrap", "the python tool", "env.sandbox")
    monkeypatch.setattr(launch, "is_root", lambda: True)
    with pytest.raises(launch.SandboxError, match="would run as root without a namespace sandbox.*"
                                                  "set env.sandbox fallback"):
        launch.decide("auto", "the python tool", "env.sandbox")
    assert launch.decide("fallback", "the python tool", "env.sandbox") == "fallback"   # said by name
    monkeypatch.setattr(launch, "is_root", lambda: False)
    with caplog.at_level("WARNING", logger="posttrain"):
        assert launch.decide("auto", "the verifier", "reward.sandbox", runs=None) == "fallback"
    assert "SANDBOX FALLBACK: the verifier runs without bubblewrap" in caplog.text
    assert "/dev/shm (RAM: 16 MB a file, any number of them" in caplog.text   # (it outlives calls)


def test_only_verifiers_known_to_parse_and_compare_fall_back(no_bwrap, monkeypatch):
    """An allow-list: `math`, `countdown` and `exact` fall back on their own (a normal user,
    `auto`, no bubblewrap); a verifier not on it (one added later: here registered by the test)
    counts as evaluating the answer and is refused, in one line naming the option, until the
    fallback is named."""
    from posttrain.config.sections import RewardConfig
    from posttrain.rewards import verifiers
    from posttrain.rewards.scorer import Scorer
    monkeypatch.setattr(no_bwrap, "is_root", lambda: False)
    monkeypatch.setitem(verifiers.VERIFIERS, "brand_new", lambda completion, problem: True)
    for name in ("math", "countdown", "exact"):
        scorer = Scorer(RewardConfig(), name)
        assert scorer.sandbox == "fallback", name
        scorer.close()
    with pytest.raises(no_bwrap.SandboxError) as refused:
        Scorer(RewardConfig(), "brand_new")
    assert "\n" not in str(refused.value) and "the verifier 'brand_new'" in str(refused.value)
    assert "set reward.sandbox fallback" in str(refused.value)
    scorer = Scorer(RewardConfig(sandbox="fallback"), "brand_new")
    assert scorer.sandbox == "fallback"
    scorer.close()


def test_without_bubblewrap_auto_refuses_what_runs_the_models_code(no_bwrap, monkeypatch):
    """A normal user, `auto`, no bubblewrap: the python tool, reward functions and
    reasoning-gym's scorers (some evaluate the answer) are refused in one line naming the option
    that accepts the fallback; named, they run there. The built-in math verifier falls back."""
    from posttrain.config.sections import RewardConfig
    from posttrain.rewards.scorer import Scorer
    monkeypatch.setattr(no_bwrap, "is_root", lambda: False)
    cfg = type("C", (), {"sandbox": "auto"})()
    with pytest.raises(no_bwrap.SandboxError) as tool_error:
        make_tools(("python",), cfg)
    message = str(tool_error.value)
    assert "\n" not in message and "the python tool would run the programs the model writes" in message
    assert "set env.sandbox fallback" in message and "POSTTRAIN_FORCE_NO_BWRAP=1" in message
    functions = RewardConfig(verifier="none", functions=("tests.toy_rewards:first_letter_a_to_e",))
    for reward, verifier in ((functions, "math"), (RewardConfig(), "reasoning_gym")):
        with pytest.raises(no_bwrap.SandboxError, match="without a namespace sandbox.*"
                                                        "set reward.sandbox fallback"):
            Scorer(reward, verifier)
    cfg.sandbox = "fallback"
    assert make_tools(("python",), cfg)[0].sandbox == "fallback"
    named = Scorer(RewardConfig(verifier="none", sandbox="fallback",
                                functions=("tests.toy_rewards:first_letter_a_to_e",)))
    assert named.sandbox == "fallback"
    assert Scorer(RewardConfig()).sandbox == "fallback"          # math-verify parses and compares


@pytest.mark.parametrize("broken", [["--no-such-option"], ["--ro-bind", "/no/such/path", "/x"]])
def test_a_sandbox_that_cannot_start_is_the_tools_failure_not_program_output(monkeypatch, broken):
    """bubblewrap refusing an option, or failing to set up a bind (after it has already named
    its child), never reaches the model as the program's output: the call raises, and the tool
    counts as broken."""
    from posttrain.envs.tools import Call, run_call
    from posttrain.sandbox import launch
    assert launch.bwrap_problem() is None   # (decided, and cached, before the options break)
    real = launch.bwrap_argv
    monkeypatch.setattr(launch, "bwrap_argv", lambda *a: real(*a)[:1] + broken + real(*a)[1:])
    tools = {t.name: t for t in make_tools(("python",), type("C", (), {"sandbox": "bwrap"})())}
    text, status = run_call(Call("python", {"code": "print(1)"}), tools, 5.0)
    assert status == "failed" and "bubblewrap could not start the sandbox" in text


@pytest.mark.parametrize("mode", MODES)
def test_memory_is_bounded_over_all_the_programs_processes(mode):
    """Four processes of 200 MB each, each under the 512 MB per-process limit: 800 MB in all is
    past python_memory_mb and the call is killed."""
    code = ("import os, time\nfor _ in range(3):\n    if os.fork() == 0: break\n"
            "b = bytearray(200 << 20)\nb[::4096] = b'x' * len(range(0, 200 << 20, 4096))\ntime.sleep(4)")
    t0 = time.monotonic()
    out = tool(code, _mode(mode), timeout_s=5.0, memory_mb=512)
    assert "more than 512 MB in all" in out and time.monotonic() - t0 < 4, out


# --- caps per turn and per episode ---------------------------------------------------------------

def test_twenty_calls_in_one_turn_run_four(tmp_path):
    env = ToolEnv(tuple(make_tools(("calculator",))), format="tag", calls_per_turn=4,
                  calls_per_episode=6)
    state = env.reset(None)
    reply = env.step(state, "<calculator>1+1</calculator>" * 20, 1)
    lines = reply.message["content"].splitlines()
    assert lines[:4] == ["2"] * 4 and all("at most 4 tool calls per turn" in x for x in lines[4:])
    assert reply.counts["tool_calls"] == 4 and reply.counts["capped_calls"] == 16
    again = env.step(state, "<calculator>1+1</calculator>" * 3, 2)   # 2 left in the episode
    assert again.counts["tool_calls"] == 2 and "per episode" in again.message["content"]


def test_tool_time_per_episode_is_capped():
    from posttrain.envs.tools import Tool
    slow = Tool("nap", "sleeps", {"type": "object", "properties": {"s": {"type": "string"}}},
                lambda s: time.sleep(float(s)) or "woke")
    env = ToolEnv((slow,), format="tag", timeout_s=5.0, seconds_per_episode=0.5)
    state = env.reset(None)
    first = env.step(state, "<nap>0.3</nap>", 1)
    second = env.step(state, "<nap>5</nap>", 2)       # 0.2 s left: cut there
    third = env.step(state, "<nap>0.1</nap>", 3)
    assert first.message["content"] == "woke" and "timed out" in second.message["content"]
    assert "tool time are used up" in third.message["content"] and third.counts["capped_calls"] == 1


# --- end to end: a 2-step run whose policy writes hostile programs for the python tool -----------

def hostile_programs(pid: int, run: Path, outside: Path, port: int) -> list[str]:
    """What a policy may hand to the python tool, one program per reply, each trying one way out."""
    return [
        f"import os\nprint(open('/proc/{pid}/environ').read(), os.environ)",     # the trainer's secrets
        f"print(open({str(run / 'config.json')!r}).read())",                      # the run folder
        f"open({str(outside)!r}, 'w').write('x')",                                # write outside
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",   # network
        "import os, time\nwhile True:\n    try: os.fork()\n    except OSError: time.sleep(0.01)",
        "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '61.9'])",
        "while True: print('x' * 100000)",                                        # unbounded output
        f"import os, signal\nos.kill({pid}, signal.SIGSTOP)\nos.killpg(os.getpgid({pid}), 9)",
        "f = open('/tmp/fill', 'wb')\nwhile True: f.write(b'x' * (1 << 20))",     # disk fill
        "print(1)\n" + "</python><python>print(2)" * 19,                          # 20 calls in a turn
    ]


@pytest.mark.slow   # (30 s: each hostile program is also run alone in the quick suite above)
def test_a_training_run_whose_policy_writes_hostile_python_finishes(bwrap, secret_env, tmp_path,
                                                                    tokenizer, monkeypatch):
    """Every program above runs (and is cut short) while a 2-step run trains; afterwards the
    trainer is running, nothing outside was written, no connection was made, no process is
    left, and the transcripts hold none of the secrets."""
    import json

    import posttrain.sampling.service as sampling
    from posttrain import load_config, train
    from tests.conftest import make_tiny_model
    from tests.test_redteam import TINY, HostileWriter
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(60)
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    run, outside = tmp_path / "run", tmp_path / "PWNED"
    texts = [f"<python>{p}</python>" for p in
             hostile_programs(os.getpid(), run, outside, server.getsockname()[1])]
    model = make_tiny_model(tokenizer)
    monkeypatch.setattr(sampling, "make_engine", lambda *a, **k: HostileWriter(model, tokenizer, texts))
    cfg = load_config(None, [*TINY, "--run_dir", str(run), "--steps", "2", "--rollout.prompts_per_step",
                             "3", "--log_samples", "12", "--env.tools", "python", "--env.max_turns",
                             "2", "--env.tool_timeout_s", "2", "--env.sandbox", "bwrap",
                             "--env.max_tokens", "1024"])
    summary = train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    server.close()
    time.sleep(0.3)
    assert summary["steps"] == 2 and not outside.exists() and accepted in ([], [None])
    assert not sleeping("61.9")      # (the flood's memory cost: test_unbounded_output_is_cut_...)
    samples = [s for line in open(run / "samples.jsonl") for s in json.loads(line)["samples"]]
    text = "\n".join(s["completion"] for s in samples)
    assert len(samples) == 24 and SECRET not in text and '"run_dir"' not in text
    assert "timed out after 2 s" in text and "File too large" in text
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(r["env/capped_calls"] > 0 for r in rows)    # the 20 calls in one turn ran 4
    assert all(r["env/tools_broken"] == 0 for r in rows)   # the model's loops are not the tool's fault


# --- the decision, end to end: said at the start, in config.json and summary.json --------------

def test_without_bubblewrap_a_run_as_root_is_refused_before_any_model_loads(no_bwrap, monkeypatch,
                                                                            tmp_path, tokenizer):
    from posttrain import load_config, train
    from tests.test_redteam import TINY
    monkeypatch.setattr(no_bwrap, "is_root", lambda: True)
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "1"])
    with pytest.raises(no_bwrap.SandboxError, match="reward scorers .* would run as root without"):
        train(cfg, show_progress=False)               # (no model passed: none was loaded)
    assert not (tmp_path / "run").exists()


def test_the_fallback_asked_for_by_name_is_recorded(no_bwrap, monkeypatch, tmp_path, tokenizer):
    import json
    from posttrain import load_config, train
    from tests.conftest import make_tiny_model
    from tests.test_redteam import TINY
    monkeypatch.setattr(no_bwrap, "is_root", lambda: True)
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "1",
                             "--reward.sandbox", "fallback", "--env.tools", "python",
                             "--env.sandbox", "fallback", "--env.max_turns", "2"])
    summary = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    isolation = {"rewards": "fallback", "tool python": "fallback"}
    assert summary["isolation"] == isolation
    assert json.loads((tmp_path / "run" / "config.json").read_text())["_isolation"] == isolation


def test_without_bubblewrap_a_normal_user_is_warned_once_at_start(no_bwrap, monkeypatch, tmp_path,
                                                                  tokenizer, caplog):
    from posttrain import load_config, train
    from tests.conftest import make_tiny_model
    from tests.test_redteam import TINY
    monkeypatch.setattr(no_bwrap, "is_root", lambda: False)
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "1"])
    with caplog.at_level("INFO", logger="posttrain"):
        summary = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert summary["isolation"] == {"rewards": "fallback"}
    assert caplog.text.count("SANDBOX FALLBACK: the reward scorers") == 1
    assert "the model's text runs in: rewards fallback" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is for root; as a normal user the run "
                    "goes on with the warning (test_without_bubblewrap_a_normal_user_is_warned)")
def test_the_command_line_refuses_in_one_line(tmp_path):
    env = {**os.environ, "POSTTRAIN_FORCE_NO_BWRAP": "1"}
    res = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", "--steps", "1",
                          "--run_dir", str(tmp_path / "run")], capture_output=True, text=True,
                         env=env, timeout=300, cwd=tmp_path)
    lines = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "would run as root without a namespace sandbox" in lines[0]
    assert "apt-get install bubblewrap" in lines[0] and "reward.sandbox fallback" in lines[0]
