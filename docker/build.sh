#!/usr/bin/env bash
# Builds a training image: docker/build.sh cpu|cuda|ascend [BUILD OPTIONS...]
#
# 1. The wheelhouse, in a temporary build context: this checkout's wheel and, for the offline install
#    (OFFLINE=1, the default), the wheels of its dependencies for the image's Python and CPU. A dependency
#    published only as an sdist (crcmod, esdk-obs-python) is built here as a pure-Python wheel (CC=false
#    makes crcmod skip its optional C extension, which would tie it to this machine's Python); the others
#    are downloaded for TARGET_PYTHON and TARGET_ARCH, so a wheelhouse built on an x86 laptop installs in
#    the aarch64 Ascend image. OFFLINE=0 puts the runtime's wheel alone in the context and the build takes
#    the dependencies from the package index.
# 2. The build: ENGINE (podman, else docker) with docker/<flavour>.Dockerfile; the context holds wheels/,
#    the entrypoint shim and install-runtime.sh, nothing else of the checkout. BUILD OPTIONS go to the engine
#    as they are: --build-arg BASE_IMAGE=..., --pull=never, --network host, --platform linux/arm64.
#
# Before either, the base image (BASE_IMAGE: --build-arg BASE_IMAGE=..., else the Dockerfile's default) must be
# here or pullable: a base that is neither fails in seconds, not after the wheelhouse. The CPU image with its
# default base, which is not here, uses local/debian:bookworm when that is here (scripts/test.sh makes it with
# debootstrap, for machines that reach no registry). Each step says what it does on stderr.
#
# Variables: TAG (default ma-runtime:<flavour>-<version>), ENGINE, PYTHON (the Python whose pip builds the
# wheelhouse, default python3), OFFLINE, TARGET_PYTHON and TARGET_ARCH (defaults: the flavour's base image),
# PULL_SECONDS (how long the base may take to pull, default 60).
# Exit codes: 78 a bad argument, 125 the base image is not here and cannot be pulled, 127 no podman or docker;
# else the failing step's own.
set -euo pipefail

usage="usage: docker/build.sh cpu|cuda|ascend [BUILD OPTIONS...]"
flavour=${1:-}
shift || true
# The Python and CPU of each flavour's default base image: Debian bookworm, Ubuntu 22.04, the platform's
# Ascend image (PyTorch 2.1, CANN 8.0.RC2, HCE 2.0).
case $flavour in
    cpu) target_python=3.11 target_arch=x86_64 ;;
    cuda) target_python=3.10 target_arch=x86_64 ;;
    ascend) target_python=3.9 target_arch=aarch64 ;;
    *) echo "docker/build.sh: unknown image '$flavour'; $usage" >&2; exit 78 ;;
esac
repo=$(cd "$(dirname "$0")/.." && pwd)
TARGET_PYTHON=${TARGET_PYTHON:-$target_python}
TARGET_ARCH=${TARGET_ARCH:-$target_arch}
PYTHON=${PYTHON:-python3}
OFFLINE=${OFFLINE:-1}
ENGINE=${ENGINE:-$(command -v podman || command -v docker || true)}
if [ -z "$ENGINE" ]; then
    echo "docker/build.sh: neither podman nor docker is installed; set ENGINE to your image builder" >&2
    exit 127
fi
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/ma_runtime/__init__.py")
TAG=${TAG:-ma-runtime:$flavour-$version}
PULL_SECONDS=${PULL_SECONDS:-60}
LOCAL_DEBIAN=local/debian:bookworm
started=$SECONDS
step() {  # what the build does now, and how long it has taken so far
    printf 'docker/build.sh: [%s] %s (%ss so far)\n' "$1" "$2" "$((SECONDS - started))" >&2
}

# The base image the build would use: --build-arg BASE_IMAGE=... (either form) wins over the Dockerfile's ARG.
base=$(sed -n 's/^ARG BASE_IMAGE=//p' "$repo/docker/$flavour.Dockerfile")
base_given=0 pull_never=0
previous=
for word in "$@"; do
    case $word in
        BASE_IMAGE=*) [ "$previous" = --build-arg ] && base=${word#BASE_IMAGE=} base_given=1 ;;
        --build-arg=BASE_IMAGE=*) base=${word#--build-arg=BASE_IMAGE=} base_given=1 ;;
        --pull=never) pull_never=1 ;;
        never) [ "$previous" = --pull ] && pull_never=1 ;;
    esac
    previous=$word
done
image_here() {
    if [ "$(basename "$ENGINE")" = podman ]; then "$ENGINE" image exists "$1"; else "$ENGINE" image inspect "$1" >/dev/null 2>&1; fi
}
if [ "$flavour" = cpu ] && [ "$base_given" = 0 ] && ! image_here "$base" && image_here "$LOCAL_DEBIAN"; then
    step "base" "$base is not here; using $LOCAL_DEBIAN (made by scripts/test.sh) with --pull=never"
    set -- "$@" --build-arg "BASE_IMAGE=$LOCAL_DEBIAN" --pull=never
    base=$LOCAL_DEBIAN pull_never=1
fi
if image_here "$base"; then
    step "base" "$base is here"
elif [ "$pull_never" = 1 ]; then
    echo "docker/build.sh: the base image $base is not here and --pull=never forbids pulling it: build or load it" \
         "first, or name one that is here with --build-arg BASE_IMAGE=IMAGE" >&2
    exit 125
else
    step "base" "$base is not here: pulling it (at most ${PULL_SECONDS}s: PULL_SECONDS)"
    if ! timeout "$PULL_SECONDS" "$ENGINE" pull -q "$base" >/dev/null 2>&1; then
        hint="give one that is here: --build-arg BASE_IMAGE=IMAGE --pull=never"
        [ "$flavour" = cpu ] && hint="$hint (bash scripts/test.sh makes $LOCAL_DEBIAN, which this script then uses)"
        echo "docker/build.sh: cannot pull the base image $base (no registry answered within ${PULL_SECONDS}s," \
             "or it refused): $hint" >&2
        exit 125
    fi
fi

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
wheels=$context/wheels

pip() {
    "$PYTHON" -m pip --disable-pip-version-check --quiet "$@"
}

# The dependencies the wheel declares (not its extras), read from its metadata: the list lives in
# pyproject.toml only.
requirements() {
    "$PYTHON" - "$wheels"/ma_runtime-*.whl <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(name).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(line.split(":", 1)[1].strip())
EOF
}

# From a copy: an in-tree build would write build/ and *.egg-info into the checkout.
step "1/3" "the runtime's wheel, from this checkout"
mkdir "$context/src"
tar -C "$repo" --exclude=__pycache__ -c pyproject.toml README.md ma_runtime | tar -C "$context/src" -x
pip wheel --no-deps -w "$wheels" "$context/src"
rm -r "$context/src"
if [ "$OFFLINE" = 1 ]; then
    step "2/3" "its dependencies' wheels for Python $TARGET_PYTHON on $TARGET_ARCH, from the package index (the slow step; OFFLINE=0 leaves them to the build)"
    requirements >"$context/requirements.txt"
    # --no-cache-dir: pip's wheel cache may hold a crcmod compiled for this machine.
    CC=false pip wheel --no-cache-dir -w "$wheels" -r "$context/requirements.txt"
    # manylinux2014 also takes manylinux2010 and manylinux1; 2_28 is the newest glibc of the wheels used.
    pip download --only-binary=:all: --python-version "$TARGET_PYTHON" --implementation cp \
        --platform "manylinux_2_28_$TARGET_ARCH" --platform "manylinux2014_$TARGET_ARCH" \
        --find-links "$wheels" -d "$wheels" -r "$context/requirements.txt"
    rm "$context/requirements.txt"
fi
install -m 0755 "$repo/entrypoints/ma-runtime-entrypoint" "$context/ma-runtime-entrypoint"
install -m 0755 "$repo/docker/install-runtime.sh" "$context/install-runtime.sh"

source_url=$(git -C "$repo" remote get-url origin 2>/dev/null || true)
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || true)
step "3/3" "building $TAG with $(basename "$ENGINE") FROM $base"
"$ENGINE" build -f "$repo/docker/$flavour.Dockerfile" -t "$TAG" \
    --build-arg "VERSION=$version" --build-arg "SOURCE_URL=$source_url" --build-arg "REVISION=$revision" \
    --build-arg "WHEELS_ONLY=$OFFLINE" "$@" "$context"
echo "built $TAG in $((SECONDS - started))s"
