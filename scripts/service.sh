#!/usr/bin/env bash
# What the scripts that run a test service in the background (moto.sh, pgbouncer.sh)
# share: how they behave sourced or run. Sourced by them; not run by itself.

# service_stop PID_VARIABLE: stop the process whose pid the variable holds (started
# by this shell), wait for it, and empty the variable. Never fails: it runs in EXIT
# traps of `set -e` scripts, where a failure would skip the rest of the cleanup
# (`wait` returns the killed process's status).
service_stop() {
    local pid="${!1:-}"
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    printf -v "$1" '%s' ''
}

# service_wait PID_VARIABLE SECONDS COMMAND...: poll COMMAND every 0.2 s until it
# succeeds (status 0), the process has exited (status 1; the variable is emptied),
# or SECONDS have passed (status 2).
service_wait() {
    local pid_var=$1 tries=$(($2 * 5))
    shift 2
    for _ in $(seq 1 "$tries"); do
        if "$@"; then return 0; fi
        if ! kill -0 "${!pid_var}" 2>/dev/null; then
            printf -v "$pid_var" '%s' ''
            return 1
        fi
        sleep 0.2
    done
    return 2
}

# service_sourced START STOP: for a script that is sourced: start, and chain STOP
# to the caller's EXIT trap. Fails (status 1) when START does.
service_sourced() {
    "$1" || return 1
    local previous
    previous="$(trap -p EXIT | sed -e "s/^trap -- '//" -e "s/' EXIT\$//")"
    # shellcheck disable=SC2064 # the caller's trap is read now, on purpose
    trap "$2; ${previous}" EXIT
}

# service_main NAME START STOP PID_VARIABLE URL_VARIABLE [COMMAND...]: for a script
# that is run: start, then run COMMAND and exit with its status, or without one
# wait for the service until Ctrl-C; STOP at exit. A service that was reused (no
# pid) is left running.
service_main() {
    local name=$1 start=$2 stop=$3 pid_var=$4 url_var=$5
    shift 5
    set -u
    "$start" || exit 1
    # shellcheck disable=SC2064 # the function's name, expanded now on purpose
    trap "$stop" EXIT INT TERM
    if [ "$#" -gt 0 ]; then
        "$@"
        exit $?
    fi
    if [ -n "${!pid_var:-}" ]; then
        echo "$name: $url_var=${!url_var}; Ctrl-C stops it" >&2
        wait "${!pid_var}"
    fi
}
