# Example pre-start hook for Ascend jobs: quiet CANN logging defaults, and a check that
# CANN's environment is applied.
#
# Copy it next to the boot file (or to the top of the code directory) as ma-pre-start.sh.
# ma_runtime SOURCES it with bash in the code directory, once per pod, after stage-in and
# before the rank-table wait; what it exports reaches every worker of every attempt, and a
# non-zero status stops the job (exit 85). So it returns, never exits, and leaves no helper
# variable or function behind in the shell that sourced it.
#
# Decisions:
# - Each default applies only where the job did not set the variable: a value from the job's
#   environment always wins. An empty value counts as not set (CANN reads it as nothing).
# - The defaults: errors only (ASCEND_GLOBAL_LOG_LEVEL=3), no plog on stdout (it would flood
#   the task log), no event log, and plogs under MA_LOG_DIR, which the log sync uploads, one
#   folder per worker (pod). The RTF launcher sets a per-rank ASCEND_PROCESS_LOG_PATH of its
#   own; this one serves torchrun, msrun and a plain command.
# - CANN's set_env.sh is sourced by the runtime before this hook unless
#   MA_RUNTIME_CANN_SET_ENV=off. Without it, ACL fails later and far from the cause, so this
#   hook stops the job at once with the reason.

_ma_ascend_default() {
    # $1: the variable, $2: its default.
    if [ -z "${!1:-}" ]; then
        export "$1=$2"
    fi
}

_ma_ascend_cann_applied() {
    local name found=""
    for name in ASCEND_TOOLKIT_HOME ASCEND_HOME_PATH; do
        [ -n "${!name:-}" ] || continue
        if [ ! -d "${!name}" ]; then
            echo "[ascend] ${name}=${!name} is not a directory: CANN is not installed there;" \
                "fix the image or the variable, or source the right set_env.sh" >&2
            return 1
        fi
        found=$name
    done
    if [ -z "$found" ]; then
        echo "[ascend] CANN's environment is not applied (neither ASCEND_TOOLKIT_HOME nor ASCEND_HOME_PATH" \
            "is set): source <CANN>/ascend-toolkit/set_env.sh, or leave MA_RUNTIME_CANN_SET_ENV unset so that" \
            "ma_runtime does" >&2
        return 1
    fi
}

_ma_ascend_main() {
    _ma_ascend_cann_applied || return 1
    _ma_ascend_default ASCEND_GLOBAL_LOG_LEVEL 3
    _ma_ascend_default ASCEND_SLOG_PRINT_TO_STDOUT 0
    _ma_ascend_default ASCEND_GLOBAL_EVENT_ENABLE 0
    if [ -n "${MA_LOG_DIR:-}" ]; then
        _ma_ascend_default ASCEND_PROCESS_LOG_PATH "${MA_LOG_DIR}/plog/worker-${VC_TASK_INDEX:-0}"
    fi
    echo "[ascend] ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL}" \
        "ASCEND_SLOG_PRINT_TO_STDOUT=${ASCEND_SLOG_PRINT_TO_STDOUT}" \
        "ASCEND_GLOBAL_EVENT_ENABLE=${ASCEND_GLOBAL_EVENT_ENABLE}" \
        "ASCEND_PROCESS_LOG_PATH=${ASCEND_PROCESS_LOG_PATH:-(unset: the CANN default)}"
}

_ma_ascend_forget() {
    unset -f _ma_ascend_default _ma_ascend_cann_applied _ma_ascend_main _ma_ascend_forget
}

# Called as an if condition so that a `set -e` in the sourcing shell cannot cut it short.
if _ma_ascend_main; then
    _ma_ascend_forget
    return 0
fi
_ma_ascend_forget
return 1
