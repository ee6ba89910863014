#!/usr/bin/env bash
# moto's SQS server for the pgoutbox-sqs tests and the sqs example.
#
#   scripts/moto.sh cargo test -p pgoutbox-sqs   # start, run the command, stop; exits with its status
#   source scripts/moto.sh                     # start in the background, export OUTBOX_SQS_ENDPOINT,
#                                              # stop when the sourcing shell exits
#   scripts/moto.sh                            # run in the foreground until Ctrl-C
#
# Port: OUTBOX_MOTO_PORT (default 5000). Installs moto with pip when moto_server is
# missing. Reuses a moto already answering on the port (and then leaves it running).
# Fails with one line on stderr and a non-zero status when moto cannot be had.

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

_moto_fail() {
    echo "moto.sh: $*" >&2
    return 1
}

_moto_answers() {
    # moto's own API answers GET /moto-api/data.json with 200.
    python3 - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/moto-api/data.json", timeout=2).read()
PY
}

_moto_stop() { service_stop MOTO_PID; }

_moto_start() {
    local port="${OUTBOX_MOTO_PORT:-5000}"
    local url="http://127.0.0.1:${port}"
    export OUTBOX_SQS_ENDPOINT="$url"
    MOTO_PID=""
    if _moto_answers "$url"; then
        echo "moto.sh: reusing moto at $url" >&2
        return 0
    fi
    command -v python3 >/dev/null 2>&1 || { _moto_fail "python3 is needed for moto and is not installed"; return 1; }
    if ! command -v moto_server >/dev/null 2>&1 || ! moto_server --help >/dev/null 2>&1; then
        echo "moto.sh: installing moto[server] with pip" >&2
        python3 -m pip install --quiet 'moto[server]' >&2 \
            || { _moto_fail "cannot install moto[server] with pip"; return 1; }
        hash -r
        command -v moto_server >/dev/null 2>&1 || { _moto_fail "moto installed but moto_server is not on PATH"; return 1; }
    fi
    local log="${TMPDIR:-/tmp}/outbox-moto-${port}.log"
    moto_server -H 127.0.0.1 -p "$port" >"$log" 2>&1 &
    MOTO_PID=$!
    local waited=0
    service_wait MOTO_PID 20 _moto_answers "$url" || waited=$?
    case $waited in
        0) echo "moto.sh: moto (pid $MOTO_PID) answers at $url" >&2 ;;
        1) _moto_fail "moto_server exited at start (port $port in use?); see $log" ;;
        *)
            _moto_stop
            _moto_fail "moto_server did not answer at $url within 20 s; see $log"
            ;;
    esac
}

service_run moto.sh _moto_start _moto_stop MOTO_PID OUTBOX_SQS_ENDPOINT "$@"
