#!/usr/bin/env bash
# Headless Chromium driven over WebDriver, for the console's browser tests
# (outbox-relay/tests/console.rs): Debian's chromium and chromium-driver, installed
# when missing (apt-get, updating the package index once if they are not found);
# chromedriver is started on 127.0.0.1 and exported as
#
#   OUTBOX_WEBDRIVER_URL   http://127.0.0.1:PORT (chromedriver)
#   OUTBOX_CHROMIUM        the browser binary chromedriver starts
#
#   scripts/chromium.sh cargo test -p pgoutbox-relay --test console   # start, run, stop
#   source scripts/chromium.sh                                        # as scripts/test.sh does
#
# Port: OUTBOX_CHROMEDRIVER_PORT (default 9515). Reuses a chromedriver already
# answering there (and then leaves it running). Fails with one line on stderr and
# a non-zero status when the browser or its driver cannot be had.

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

_chromium_fail() {
    echo "chromium.sh: $*" >&2
    return 1
}

# chromedriver answers GET /status with {"value":{"ready":true,...}}.
_chromium_answers() {
    python3 - "$1" <<'PY' >/dev/null 2>&1
import json, sys, urllib.request
status = json.load(urllib.request.urlopen(sys.argv[1] + "/status", timeout=2))
sys.exit(0 if status["value"]["ready"] else 1)
PY
}

_chromium_stop() { service_stop CHROMEDRIVER_PID; }

_chromium_start() {
    local port="${OUTBOX_CHROMEDRIVER_PORT:-9515}"
    local url="http://127.0.0.1:${port}"
    export OUTBOX_WEBDRIVER_URL="$url"
    CHROMEDRIVER_PID=""
    service_install_debian chromium.sh chromium chromium-driver || return 1
    local browser
    browser=$(command -v chromium || echo /usr/bin/chromium)
    [ -x "$browser" ] || { _chromium_fail "FAILED: no chromium binary after installing chromium"; return 1; }
    export OUTBOX_CHROMIUM="$browser"
    if _chromium_answers "$url"; then
        echo "chromium.sh: reusing chromedriver at $url" >&2
        return 0
    fi
    command -v chromedriver >/dev/null 2>&1 || { _chromium_fail "FAILED: no chromedriver after installing chromium-driver"; return 1; }
    local log="${TMPDIR:-/tmp}/outbox-chromedriver-${port}.log"
    chromedriver --port="$port" --allowed-ips=127.0.0.1 >"$log" 2>&1 &
    CHROMEDRIVER_PID=$!
    if service_await CHROMEDRIVER_PID 20 "$log" _chromium_stop _chromium_answers "$url"; then
        echo "chromium.sh: chromedriver (pid $CHROMEDRIVER_PID) answers at $url" >&2
    else
        _chromium_fail "FAILED: chromedriver did not answer at $url within 20 s: $SERVICE_LOG_TAIL"
    fi
}

service_run chromium.sh _chromium_start _chromium_stop CHROMEDRIVER_PID OUTBOX_WEBDRIVER_URL "$@"
