#!/usr/bin/env bash
# The system packages the test suite needs beyond pip, on Debian or Ubuntu: a headless Chromium (the
# gallery tests open the gallery in it) and HAProxy (the Serve tests run the server behind it, as
# `snapref-ray serve` does when haproxy is installed). README.md and .ci/run both call this script.
#
#   scripts/install-test-deps.sh           install what is missing (as root, else through sudo)
#   scripts/install-test-deps.sh --plan    print what a fresh machine of this OS would run; run nothing
#
# Debian: chromium, chromium-driver and haproxy from the archive. Ubuntu: haproxy from the archive,
# but Chromium as Google Chrome's .deb (amd64 only): Ubuntu's chromium, chromium-browser and
# chromium-driver packages only install the snap, which needs a running snapd (containers have
# none) and whose confinement keeps the browser out of /tmp, where the tests write their pages.
# SNAPREF_OS_RELEASE=FILE reads another os-release file (to see the plan for another OS).
set -euo pipefail

CHROME_DEB_URL=https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb
# The names tests/report/browser.py looks for, in its order.
BROWSERS=(chromium chromium-browser google-chrome google-chrome-stable)

plan_only=false
case "${1:-}" in
  --plan) plan_only=true ;;
  "") ;;
  *) echo "usage: $0 [--plan]" >&2; exit 2 ;;
esac

os_release=${SNAPREF_OS_RELEASE:-/etc/os-release}
if [ ! -r "$os_release" ]; then
  echo "error: cannot read $os_release: this script knows Debian and Ubuntu only" >&2
  exit 1
fi
os_id=$(. "$os_release" && echo "${ID:-}")
os_like=$(. "$os_release" && echo "${ID_LIKE:-}")
os_name=$(. "$os_release" && echo "${PRETTY_NAME:-$ID}")
if [ "$os_id" = ubuntu ] || [[ " $os_like " == *" ubuntu "* ]]; then
  family=ubuntu
elif [ "$os_id" = debian ] || [[ " $os_like " == *" debian "* ]]; then
  family=debian
else
  echo "error: $os_name is neither Debian nor Ubuntu; install by hand: a chromium (or google-chrome)" \
    "binary on PATH and haproxy" >&2
  exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=""
else
  sudo="sudo "
fi

# Ubuntu's browser .deb is downloaded into a folder of our own (not a fixed name in /tmp that another
# user could have placed), readable by apt's unprivileged download user, and removed at exit.
download_dir=""
if [ "$family" = ubuntu ]; then
  download_dir=$(mktemp -d)
  chmod 755 "$download_dir"
  trap 'rm -rf "$download_dir"' EXIT
fi

# A browser counts only if it runs: Ubuntu's snap wrappers exist on PATH without a working browser.
working_browser() {
  local name
  for name in "${BROWSERS[@]}"; do
    if command -v "$name" >/dev/null 2>&1 && timeout 60 "$name" --version >/dev/null 2>&1; then
      echo "$name"
      return 0
    fi
  done
  return 1
}

# The tests take the first of BROWSERS on PATH: say so when a broken one comes before the working one.
warn_if_shadowed() {
  local working=$1 name
  for name in "${BROWSERS[@]}"; do
    [ "$name" = "$working" ] && return 0
    if command -v "$name" >/dev/null 2>&1; then
      echo "warning: $(command -v "$name") does not run; the tests would pick it first:" \
        "export CHROMIUM=$working" >&2
      return 0
    fi
  done
}

have_haproxy() {
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]
}

# The commands, one per line, that install the parts named missing (both: a fresh machine).
commands() {
  local need_browser=$1 need_haproxy=$2 packages=()
  if [ "$family" = debian ]; then
    $need_browser && packages+=(chromium chromium-driver)
    $need_haproxy && packages+=(haproxy)
    if [ ${#packages[@]} -gt 0 ]; then
      echo "${sudo}apt-get update"
      echo "${sudo}apt-get install -y ${packages[*]}"
    fi
    return 0
  fi
  $need_haproxy && packages+=(haproxy)
  $need_browser && packages+=(ca-certificates curl)
  if [ ${#packages[@]} -gt 0 ]; then
    echo "${sudo}apt-get update"
    echo "${sudo}apt-get install -y ${packages[*]}"
  fi
  if $need_browser; then
    echo "curl -fsSL -o $download_dir/google-chrome-stable_current_amd64.deb $CHROME_DEB_URL"
    echo "${sudo}apt-get install -y $download_dir/google-chrome-stable_current_amd64.deb"
  fi
}

if $plan_only; then
  commands true true
  exit 0
fi

need_browser=true
need_haproxy=true
if found=$(working_browser); then
  need_browser=false
  echo "browser: $found ($(command -v "$found"))"
  warn_if_shadowed "$found"
fi
if have_haproxy; then
  need_haproxy=false
  echo "haproxy: $(command -v haproxy || echo /usr/sbin/haproxy)"
fi
if ! $need_browser && ! $need_haproxy; then
  echo "nothing to install"
  exit 0
fi
if [ -n "$sudo" ] && ! command -v sudo >/dev/null 2>&1; then
  echo "error: not root and no sudo: run this script as root, or install sudo first" >&2
  exit 1
fi
if $need_browser && [ "$family" = ubuntu ] && [ "$(dpkg --print-architecture)" != amd64 ]; then
  echo "error: Google Chrome's .deb is amd64 only and Ubuntu's Chromium is a snap; on" \
    "$(dpkg --print-architecture) install a Chromium build by hand and set CHROMIUM=/path/to/it" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
while IFS= read -r command; do
  echo "+ $command"
  # sudo keeps DEBIAN_FRONTEND only when told to (env_reset); apt-get itself needs no other variable.
  eval "${command/#sudo /sudo DEBIAN_FRONTEND=noninteractive }"
done < <(commands "$need_browser" "$need_haproxy")

if $need_browser && ! found=$(working_browser); then
  echo "error: no working browser after the install (looked for ${BROWSERS[*]})" >&2
  exit 1
fi
if $need_haproxy && ! have_haproxy; then
  echo "error: haproxy is not installed after the install" >&2
  exit 1
fi
echo "installed: ${found:+browser $found }$(have_haproxy && echo haproxy)"
warn_if_shadowed "$found"
