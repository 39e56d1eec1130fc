#!/usr/bin/env bash
# The opt-in check against the real vLLM (issue 26), on the CPU: not part of .ci/run, because
# vLLM's wheel brings ~9.5 GB (torch with CUDA included; about 4 minutes to install here).
#
#   examples/integrations/vllm_check.sh [pytest args...]     # VLLM_VENV=path to use another venv
#
# Builds the venv when it is missing or holds another vLLM (python3.11 -m venv; pip install
# vllm==0.33.0 transformers pytest pytest-timeout), installs the four rlfleet packages into it in
# editable mode (so the tests run this checkout's code; the weightsync install also registers its
# vllm.general_plugins entry point), then runs tests/e2e/test_vllm.py -m vllm.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.33.0
PY="$VENV/bin/python"
export VLLM_TARGET_DEVICE=cpu

if "$PY" -c "import vllm, transformers, pytest, pytest_timeout, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" \
  2>/dev/null; then
  echo "venv ok: $VENV"
else
  echo "building $VENV (vllm==$VLLM_VERSION, ~9.5 GB)"
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "vllm==$VLLM_VERSION" transformers pytest pytest-timeout
fi
if ! "$PY" -c "import sys, rlfleet.weightsync as w; sys.exit(not w.__file__.startswith('$PWD/'))" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --no-deps \
    -e packages/weightsync -e packages/routing -e packages/placement -e packages/policygroup
fi
"$PY" -c 'import sys, torch, transformers, vllm, rlfleet.weightsync as w
print(f"python {sys.version.split()[0]}, vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, rlfleet-weightsync {w.__version__} at {w.__file__}")' 2>&1 | tail -1
exec "$PY" -m pytest tests/e2e/test_vllm.py -m vllm -v -p no:cacheprovider -p no:randomly "$@"
