#!/usr/bin/env bash
# What the scripts that run a test service in the background (moto.sh, pgbouncer.sh,
# tansu.sh, chromium.sh) share: how they wait for it, stop it, and behave sourced
# or run; how they install Debian packages (go.sh too); and the
# port probe that test.sh and rabbitmq-tls.sh use too. Sourced by them; not run by
# itself.

# service_port_open PORT: something listens on 127.0.0.1:PORT.
service_port_open() { timeout 1 bash -c ">/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# service_install_debian NAME PACKAGE...: install the Debian packages that are not
# installed yet (apt-get, updating the package index once if they are not found).
# Fails (status 1) with one line naming them when they cannot be installed.
service_install_debian() {
    local name=$1 missing=() package
    shift
    for package in "$@"; do
        dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "$name: installing ${missing[*]} (Debian packages)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null; } \
        || { echo "$name: FAILED: could not install the Debian packages ${missing[*]}" >&2; return 1; }
}

# service_stop PID_VARIABLE [PATH_VARIABLE]: stop the process whose pid the variable
# holds (started by this shell), wait for it, and empty the variable; with
# PATH_VARIABLE, also delete the file or folder it names (the service's scratch
# space) and empty it. Never fails: it runs in EXIT traps of `set -e` scripts, where
# a failure would skip the rest of the cleanup (`wait` returns the killed process's
# status).
service_stop() {
    local pid="${!1:-}"
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    printf -v "$1" '%s' ''
    if [ -n "${2:-}" ] && [ -n "${!2:-}" ]; then
        rm -rf "${!2}"
        printf -v "$2" '%s' ''
    fi
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

# service_await PID_VARIABLE SECONDS LOG STOP COMMAND...: wait for a service just
# started (service_wait). When COMMAND does not succeed in time, stop the service
# with STOP and fail (status 1), leaving the last lines of its LOG, on one line, in
# SERVICE_LOG_TAIL for the caller's message (read first: STOP may delete LOG).
service_await() {
    local pid_var=$1 seconds=$2 log=$3 stop=$4
    shift 4
    if service_wait "$pid_var" "$seconds" "$@"; then return 0; fi
    SERVICE_LOG_TAIL="$(tail -n 3 "$log" | tr '\n' ' ')"
    "$stop"
    return 1
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

# service_run NAME START STOP PID_VARIABLE URL_VARIABLE [COMMAND...]: the last line
# of a service script. Sourced, it starts the service in the background
# (service_sourced; the status of the `source`); run, it is service_main. Sourced
# or run is told by the script that called this function (BASH_SOURCE[1]): run,
# it is $0.
service_run() {
    if [ "${BASH_SOURCE[1]}" != "$0" ]; then
        service_sourced "$2" "$3"
        return
    fi
    service_main "$@"
}
