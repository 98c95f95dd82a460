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
import threading
import time
from pathlib import Path

import pytest

from posttrain.envs.builtin import ToolEnv
from posttrain.envs.sandbox import Limits, bwrap_works, run_python_code, sandbox_mode
from posttrain.envs.tools import make_tools, run_python

SECRET = "hunter2-posttrain-secret"


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

def test_the_trainers_environment_is_out_of_reach(bwrap, secret_env):
    pid = os.getpid()
    out = tool(f"import os\nfor p in ('/proc/{pid}/environ', '/proc/self/environ', '/proc/1/environ'):\n"
               f"    try: print(open(p).read())\n    except OSError as e: print(type(e).__name__)\n"
               f"print(os.environ)", bwrap)
    assert SECRET not in out and "FileNotFoundError" in out


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


def test_the_sandbox_tmp_is_bounded(bwrap):
    out = tool("f = open('/tmp/fill', 'wb')\nfor i in range(1024): f.write(b'x' * (1 << 20))",
               bwrap, tmp_mb=8)
    assert "No space left" in out or "File too large" in out


# --- what both modes do --------------------------------------------------------------------------

MODES = ["bwrap", "fallback"]


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


def test_auto_picks_bwrap_where_it_works_and_bwrap_demanded_without_it_is_refused(monkeypatch):
    assert sandbox_mode("fallback") == "fallback"
    assert sandbox_mode("auto") == ("bwrap" if bwrap_works() else "fallback")
    import posttrain.envs.sandbox as sandbox
    monkeypatch.setattr(sandbox, "bwrap_works", lambda: False)
    with pytest.raises(ValueError, match="apt-get install bubblewrap"):
        sandbox.sandbox_mode("bwrap")


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


def test_a_training_run_whose_policy_writes_hostile_python_finishes(bwrap, secret_env, tmp_path,
                                                                    tokenizer, monkeypatch):
    """Every program above runs (and is cut short) while a 2-step run trains; afterwards the
    trainer is running, nothing outside was written, no connection was made, no process is
    left, and the transcripts hold none of the secrets."""
    import json

    import posttrain.train_run as train_run
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
    monkeypatch.setattr(train_run, "make_engine", lambda *a, **k: HostileWriter(model, tokenizer, texts))
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
