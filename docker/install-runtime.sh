#!/bin/sh
# Installs ma-runtime into an image; run as root by each of docker/*.Dockerfile, from the build context that
# docker/build.sh assembles (wheels/, ma-runtime-entrypoint, this script). The three images differ in their
# base and the job's Python; what this script does is the same in all of them, so the CPU image the tests build
# checks the CUDA and Ascend ones too.
#
# - The user: `ma-user`, uid MA_USER_UID (1000), primary group `ma-group`, gid MA_USER_GID (100), home
#   /home/ma-user owned by them (the platform's rules for custom images). A base that has the uid
#   or the gid already under another name (Ubuntu's `ubuntu`, Debian's `users` group, a platform image's own
#   ma-user) has it renamed, not duplicated: files it owns keep their owner.
# - The runtime: a virtual environment of its own in /opt/ma-runtime/venv, from the wheelhouse alone
#   (WHEELS_ONLY=1, offline) or with the dependencies from the package index (WHEELS_ONLY=0). pip is removed
#   from it afterwards: the job's packages go into the job's Python, never here.
# - The commands: ma-runtime, ma-run and ma-preflight in /usr/local/bin, each a two-line sh wrapper that runs
#   the venv's python isolated (-I); the venv's bin folder is never on PATH, so `python` stays the job's.
# - No setuid or setgid file is left (the platform refuses images with root-owned ones), whatever the base
#   brought.
set -eu

context=$(dirname "$0")
uid=${MA_USER_UID:-1000}
gid=${MA_USER_GID:-100}
python=${RUNTIME_PYTHON:-python3}
prefix=/opt/ma-runtime
home=/home/ma-user

fail() {
    echo "install-runtime.sh: $*" >&2
    exit 1
}

ensure_group() {  # ma-group with gid $gid
    existing=$(getent group "$gid" | cut -d: -f1)
    if [ "$existing" = ma-group ]; then
        return
    fi
    if getent group ma-group >/dev/null; then
        fail "the base image has a group ma-group whose gid is not $gid: build with --build-arg MA_USER_GID=<its gid>"
    fi
    if [ -n "$existing" ]; then
        groupmod -n ma-group "$existing"
    else
        groupadd -g "$gid" ma-group
    fi
}

ensure_user() {  # ma-user with uid $uid, group $gid, home $home
    existing=$(getent passwd "$uid" | cut -d: -f1)
    if [ -z "$existing" ] && getent passwd ma-user >/dev/null; then
        fail "the base image has a user ma-user whose uid is not $uid: build with --build-arg MA_USER_UID=<its uid>"
    fi
    if [ -z "$existing" ]; then
        # -l: no lastlog/faillog entries, which are sparse files sized by the uid.
        useradd -l -u "$uid" -g "$gid" -d "$home" -s "$(login_shell)" ma-user
    else
        [ "$existing" = ma-user ] || usermod -l ma-user "$existing"
        [ "$(getent passwd ma-user | cut -d: -f4,6)" = "$gid:$home" ] || usermod -g "$gid" -d "$home" ma-user
    fi
    # Not -R: a base's home may hold gigabytes (the platform's conda), already owned by its user.
    mkdir -p "$home"
    chown "$uid:$gid" "$home"
}

login_shell() {
    if [ -x /bin/bash ]; then echo /bin/bash; else echo /bin/sh; fi
}

install_runtime() {
    "$python" -m venv "$prefix/venv"
    offline=
    if [ "${WHEELS_ONLY:-1}" = 1 ]; then offline=--no-index; fi
    # The Dockerfile's empty default: pip would take "" for an index; unset, the base's pip.conf or PyPI.
    if [ -z "${PIP_INDEX_URL:-}" ]; then unset PIP_INDEX_URL; fi
    # The wheel by its file, never by its name: an index could hold another project called ma-runtime.
    set -- "$context"/wheels/ma_runtime-*.whl
    [ $# = 1 ] && [ -f "$1" ] || fail "expected one ma_runtime wheel in the build context's wheels/, found: $*"
    "$prefix/venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check --no-input $offline \
        --find-links "$context/wheels" "$1"
    "$prefix/venv/bin/python" -m pip uninstall --yes --quiet --disable-pip-version-check pip setuptools
    # A failed import here fails the build, not the first job.
    "$prefix/venv/bin/python" -I -c "import ma_runtime.cli"
}

install_commands() {
    mkdir -p "$prefix/bin"
    install -m 0755 "$context/ma-runtime-entrypoint" "$prefix/bin/ma-runtime-entrypoint"
    for name in ma-runtime ma-run ma-preflight; do
        # The console script run by path, not by its shebang: its name stays the program's name (ma-run's
        # signal regime starts on it) and -I keeps the job's PYTHONPATH out.
        printf '#!/bin/sh\nexec %s/venv/bin/python -I %s/venv/bin/%s "$@"\n' "$prefix" "$prefix" "$name" \
            >"$prefix/bin/$name"
        chmod 0755 "$prefix/bin/$name"
        ln -sf "$prefix/bin/$name" "/usr/local/bin/$name"
    done
}

strip_setuid() {
    # -xdev: the image's own files, not /proc or a file the build engine mounts in.
    find / -xdev -perm /6000 -type f -exec chmod a-s {} +
}

ensure_group
ensure_user
install_runtime
install_commands
strip_setuid
