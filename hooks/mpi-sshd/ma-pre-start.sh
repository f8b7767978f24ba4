# Example pre-start hook for MPI jobs: start an sshd, as the job's own user, that mpirun on
# worker-0 can reach on every node.
#
# Copy it next to the boot file (or to the top of the code directory) as ma-pre-start.sh.
# ma_runtime SOURCES it with bash in the code directory, once per pod, after stage-in and
# before the rank-table wait; what it exports reaches every worker of every attempt, and a
# non-zero status stops the job (exit 85). So it returns, never exits, and leaves no helper
# variable or function behind in the shell that sourced it.
#
# This is for images that run mpirun from their own script. With the runtime's own mpirun
# launcher (MA_RUN_METHOD=mpirun), which starts sshd itself, do not use it: the two would
# want the same port.
#
# Decisions:
# - Port: MY_SSHD_PORT, default 36666, the default of the platform's run_mpi.sh, so that this
#   sshd and a run_mpi.sh-style script agree without configuration. It is exported.
# - Config: ${MA_HOME}/etc/ssh/sshd_config (the MPI image convention) with {{MY_SSHD_PORT}}
#   replaced, written to a private copy: the image's file is never edited, so a second start
#   in the same container still finds the placeholder. Without one, a minimal config. The
#   port is also given as -p, which overrides every Port line of the config.
# - sshd keeps the first value it reads for most keywords, so the settings a non-root sshd
#   needs come first in the copy: PidFile in the private folder, UsePAM no and StrictModes no
#   (the trust files are often mounted read-only with modes or owners sshd would refuse),
#   AuthorizedKeysFile from the trust folder.
# - Host key: the config's own when one is readable; otherwise one generated for this job in
#   the private folder (a non-root sshd cannot read /etc/ssh's keys).
# - Trust folder: ${MA_HOME}/.ssh (where the platform puts authorized_keys, config, id_rsa),
#   else $HOME/.ssh. The ssh client refuses a private key others can read and a config others
#   can write; those modes are fixed in place (700 folder, 600 files), and when the folder is
#   read-only they are fixed on copies in the private folder instead. MA_SSH_DIR names the
#   folder to use: with copies, pass `-F "$MA_SSH_DIR/config"` to ssh (it names the keys).
# - Paths in the configs: sshd's and ssh's config files split words at spaces and quotes and
#   expand % tokens, and Open MPI splits plm_rsh_args at every space, so every path the hook
#   writes into them, and MA_SSH_DIR, is plain (letters, digits, _./+,:@-). A trust folder
#   whose path is not (a MA_HOME with a space, say) is used through copies in the private
#   folder; a TMPDIR whose path is not gives way to /tmp for the private folder.
# - sshd runs with -D in the background rather than daemonising itself: a daemonising sshd
#   forks before it binds the port, so its status says nothing about the port and the failure
#   (a port in use) would go unseen. The hook knows the pid, waits for the pid file (written
#   once the port is bound), and fails with sshd's last log line if sshd died instead.
# - Exports MA_SSHD_PID_FILE (sshd's pid file; its log is sshd.log beside it), MY_SSHD_PORT
#   and MA_SSH_DIR.

_ma_sshd_say() {
    echo "[mpi-sshd] $*" >&2
}

# Whether the path $1 can go into sshd's and ssh's config files (and plm_rsh_args) as it is.
_ma_sshd_plain() {
    case $1 in
        '' | *[!A-Za-z0-9_./+,:@-]*) return 1 ;;
    esac
}

# Whether ssh accepts the modes of the private key $1: a key we own must be readable by us
# alone (ssh's own rule; a key owned by another user, such as root, is not checked).
_ma_sshd_key_modes_ok() {
    local mode uid
    read -r mode uid <<<"$(stat -L -c '%a %u' "$1" 2>/dev/null)"
    [ -z "$mode" ] || [ "$uid" != "$(id -u)" ] || [ $((8#$mode & 8#077)) -eq 0 ]
}

# Whether the ssh client accepts the trust folder $1 as it is: its private keys (above), and
# its config owned by us or root and writable by nobody else.
_ma_sshd_trust_ok() {
    local file mode uid
    for file in "$1"/id_*; do
        [ -f "$file" ] && [ "${file%.pub}" = "$file" ] || continue
        _ma_sshd_key_modes_ok "$file" || return 1
    done
    [ -f "$1/config" ] || return 0
    read -r mode uid <<<"$(stat -L -c '%a %u' "$1/config" 2>/dev/null)"
    [ -n "$mode" ] && { [ "$uid" = "$(id -u)" ] || [ "$uid" = 0 ]; } && [ $((8#$mode & 8#022)) -eq 0 ]
}

# Sets the modes ssh wants on the trust folder $1; where they cannot be set (a read-only
# mount, another owner), copies it into $2 with those modes. Prints the folder to use.
_ma_sshd_trust_dir() {
    local source=$1 copy=$2 file why
    if [ ! -d "$source" ]; then
        if _ma_sshd_plain "$source"; then
            echo "$source"
        else  # an empty folder the configs can name
            mkdir -m 700 "$copy" && echo "$copy"
        fi
        return
    fi
    chmod 700 "$source" 2>/dev/null
    for file in "$source"/id_* "$source"/authorized_keys "$source"/config; do
        if [ -f "$file" ] && [ "${file%.pub}" = "$file" ]; then
            chmod 600 "$file" 2>/dev/null
        fi
    done
    if ! _ma_sshd_plain "$source"; then
        why="its path has characters sshd's and ssh's config files cannot take"
    elif ! _ma_sshd_trust_ok "$source"; then
        why="it has modes ssh refuses and they cannot be changed"
    else
        echo "$source"
        return 0
    fi
    mkdir -m 700 "$copy" || return 1
    for file in "$source"/*; do
        # -L: Kubernetes secret volumes hold links into a ..data folder.
        [ -f "$file" ] || continue
        if [ ! -r "$file" ]; then
            _ma_sshd_say "cannot read $file: not copied"
            continue
        fi
        cp -L "$file" "$copy/" && chmod 600 "$copy/${file##*/}" || return 1
    done
    _ma_sshd_point_config_at_copies "$copy" || return 1
    _ma_sshd_say "$source: $why; using copies in $copy (ssh -F $copy/config)"
    echo "$copy"
}

# ssh's default key paths are the read-only originals: the copied config names the copies first.
_ma_sshd_point_config_at_copies() {
    local copy=$1 file keys=""
    for file in "$copy"/id_*; do
        [ -f "$file" ] && [ "${file%.pub}" = "$file" ] || continue
        if _ma_sshd_plain "$file"; then
            keys+="IdentityFile $file"$'\n'
        else
            _ma_sshd_say "$file is not named in $copy/config: its name has characters ssh's config cannot take"
        fi
    done
    { printf '%s' "$keys"; cat "$copy/config" 2>/dev/null; } >"$copy/config.new" &&
        mv -f "$copy/config.new" "$copy/config" && chmod 600 "$copy/config"
}

# Whether the sshd config $1 names a host key sshd will load as this user.
_ma_sshd_has_host_key() {
    local key
    while read -r key; do
        [ -n "$key" ] && [ -r "$key" ] && _ma_sshd_key_modes_ok "$key" && return 0
    done < <(awk '{ sub(/^[ \t]+/, "") } tolower($1) == "hostkey" { print $2 }' FS='[ \t=]+' "$1")
    return 1
}

# Writes the private config $2 for port $3 from the image's config $1 (or a minimal one), with
# the private folder $4 and the authorized_keys $5.
_ma_sshd_config() {
    local image=$1 config=$2 port=$3 dir=$4 keys=$5 body="$2.body" host_key=""
    if [ -f "$image" ]; then
        sed "s/{{MY_SSHD_PORT}}/${port}/g" "$image" >"$body" || return 1
    else
        printf '%s\n' "PubkeyAuthentication yes" "PasswordAuthentication no" \
            "ChallengeResponseAuthentication no" >"$body" || return 1
    fi
    if ! _ma_sshd_has_host_key "$body"; then
        host_key="$dir/ssh_host_ed25519_key"
        ssh-keygen -q -t ed25519 -N '' -f "$host_key" >/dev/null </dev/null || return 1
    fi
    {
        echo "# Written by the mpi-sshd pre-start hook; these lines come first because sshd keeps the first value."
        echo "PidFile $dir/sshd.pid"
        echo "UsePAM no"
        echo "StrictModes no"
        echo "AuthorizedKeysFile $keys"
        if [ -n "$host_key" ]; then
            echo "HostKey $host_key"
        fi
        if [ -f "$image" ]; then
            # Not the path itself: a newline in it would make a config line of the rest.
            echo "# \${MA_HOME}/etc/ssh/sshd_config, its port placeholder replaced:"
        fi
        cat "$body"
    } >"$config" && rm -f "$body"
}

# Waits until sshd ($2, started with the private folder $1) has bound its port: it writes its pid
# file then. Stops it if it has not within 10 s, far beyond what binding a port takes.
_ma_sshd_wait() {
    local dir=$1 pid=$2 tries=100
    while [ "$tries" -gt 0 ]; do
        kill -0 "$pid" 2>/dev/null || return 1
        [ "$(cat "$dir/sshd.pid" 2>/dev/null)" = "$pid" ] && return 0
        sleep 0.1
        tries=$((tries - 1))
    done
    kill "$pid" 2>/dev/null
    echo "no pid file after 10 s" >>"$dir/sshd.log"
    return 1
}

_ma_sshd_main() {
    local port=${MY_SSHD_PORT:-36666} port_ok=no sshd tmp dir trust_source trust
    case $port in
        '' | *[!0-9]*) port_ok=no ;;
        *) [ "${#port}" -le 5 ] && [ $((10#$port)) -ge 1 ] && [ $((10#$port)) -le 65535 ] && port_ok=yes ;;
    esac
    if [ "$port_ok" != yes ]; then
        _ma_sshd_say "MY_SSHD_PORT=$port is not a port number: set it to a number from 1 to 65535"
        return 1
    fi
    port=$((10#$port))
    if [ -n "${MA_SSHD_PID_FILE:-}" ] && kill -0 "$(cat "$MA_SSHD_PID_FILE" 2>/dev/null)" 2>/dev/null; then
        _ma_sshd_say "sshd already runs (pid file $MA_SSHD_PID_FILE)"
        return 0
    fi
    sshd=$(command -v sshd)
    [ "${sshd:0:1}" = / ] || sshd=/usr/sbin/sshd  # sshd re-executes itself, so it needs an absolute path
    if [ ! -x "$sshd" ]; then
        _ma_sshd_say "sshd not found on PATH or at /usr/sbin/sshd: install OpenSSH's server in the image" \
            "(Debian/Ubuntu: openssh-server; EulerOS/CentOS: openssh-server)"
        return 1
    fi
    if ! command -v ssh-keygen >/dev/null; then
        _ma_sshd_say "ssh-keygen not found on PATH: install OpenSSH's client in the image"
        return 1
    fi
    tmp=${TMPDIR:-/tmp}
    _ma_sshd_plain "$tmp" || tmp=/tmp  # the private folder's paths go into the configs
    if ! dir=$(mktemp -d "$tmp/ma-sshd.XXXXXX"); then
        _ma_sshd_say "cannot make a private folder in $tmp: set TMPDIR to a writable folder" \
            "(its path of letters, digits and _./+,:@- only)"
        return 1
    fi
    trust_source="${MA_HOME:-/home/ma-user}/.ssh"
    if [ ! -f "$trust_source/authorized_keys" ] && [ -f "${HOME:-/nonexistent}/.ssh/authorized_keys" ]; then
        trust_source="$HOME/.ssh"
    fi
    if [ ! -f "$trust_source/authorized_keys" ]; then
        _ma_sshd_say "no authorized_keys in ${MA_HOME:-/home/ma-user}/.ssh or ${HOME:-~}/.ssh:" \
            "sshd accepts no key until one is there"
    fi
    if ! trust=$(_ma_sshd_trust_dir "$trust_source" "$dir/ssh"); then
        _ma_sshd_say "cannot copy $trust_source into $dir/ssh"
        return 1
    fi
    if ! _ma_sshd_config "${MA_HOME:-/home/ma-user}/etc/ssh/sshd_config" "$dir/sshd_config" "$port" "$dir" \
        "$trust/authorized_keys"; then
        _ma_sshd_say "cannot write sshd's config or host key in $dir"
        return 1
    fi
    # As root sshd needs its privilege separation folder; Debian's package makes it only at boot.
    if [ "$(id -u)" = 0 ] && [ ! -d /run/sshd ] && [ -d /run ]; then
        mkdir -m 755 /run/sshd 2>/dev/null
    fi
    "$sshd" -D -f "$dir/sshd_config" -E "$dir/sshd.log" -p "$port" </dev/null >/dev/null 2>&1 &
    if ! _ma_sshd_wait "$dir" $!; then
        _ma_sshd_say "sshd did not start on port $port: $(tail -n 1 "$dir/sshd.log" 2>/dev/null)" \
            "(log: $dir/sshd.log)"
        return 1
    fi
    export MA_SSHD_PID_FILE="$dir/sshd.pid" MY_SSHD_PORT="$port" MA_SSH_DIR="$trust"
    _ma_sshd_say "sshd listens on port $port (pid $(cat "$MA_SSHD_PID_FILE"), log $dir/sshd.log, trust files $trust)"
}

_ma_sshd_forget() {
    unset -f _ma_sshd_say _ma_sshd_plain _ma_sshd_key_modes_ok _ma_sshd_trust_ok _ma_sshd_trust_dir \
        _ma_sshd_point_config_at_copies _ma_sshd_has_host_key _ma_sshd_config _ma_sshd_wait _ma_sshd_main \
        _ma_sshd_forget
}

# Called as an if condition so that a `set -e` in the sourcing shell cannot cut it short.
if _ma_sshd_main; then
    _ma_sshd_forget
    return 0
fi
_ma_sshd_forget
return 1
