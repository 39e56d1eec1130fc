# Sourced by .ci/run and .ci/packages: put python3.10, python3.11 and python3.12 on PATH (pyenv
# shims resolve only the versions PYENV_VERSION lists, 3.11 first: python3 stays 3.11) and fail
# loudly if one is missing. hatch.toml's compat matrix (routing and placement on 3.10 and 3.12) and
# the packaging stage need them. hatch does not skip a matrix Python it cannot find: it downloads
# a Python build (here, offline, a ConnectError once the suites before it ran), so it is checked
# here, before anything runs.
if command -v pyenv >/dev/null 2>&1; then
  _pick() { pyenv versions --bare | grep -E "^$1\.[0-9]+$" | sort -V | tail -1; }
  PYENV_VERSION="$(_pick 3.11):$(_pick 3.10):$(_pick 3.12)"
  export PYENV_VERSION
  unset -f _pick
fi
for _v in 3.11 3.10 3.12; do
  if ! "python$_v" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$_v'.split('.')))" 2>/dev/null; then
    printf '\nMISSING PYTHON: python%s is not on PATH (pyenv: %s). hatch.toml tests on 3.10, 3.11 and 3.12;\n' \
      "$_v" "${PYENV_VERSION:-no pyenv}" >&2
    printf 'install it (pyenv install %s) before running CI.\n' "$_v" >&2
    exit 1
  fi
done
unset _v
echo "Pythons: $(python3.10 -V 2>&1), $(python3.11 -V 2>&1), $(python3.12 -V 2>&1); python3 is $(python3 -V 2>&1)"
