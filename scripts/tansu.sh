#!/usr/bin/env bash
# tansu, a Kafka-protocol broker process (Rust, Apache-2.0, in-memory storage), for
# the Kafka tests that run against a real broker (outbox-kafka/tests/conformance.rs).
#
#   source scripts/tansu.sh        # start in the background, export OUTBOX_TANSU_BROKERS,
#                                  # stop when the sourcing shell exits
#   scripts/tansu.sh cargo test -p pgoutbox-kafka --test conformance
#                                  # start, run the command, stop; exits with its status
#   scripts/tansu.sh               # run in the foreground until Ctrl-C
#
# Installs tansu when it is missing: `cargo install tansu` (a pinned version, with
# the `dynostore` feature that its in-memory storage needs) into OUTBOX_TOOLS_DIR
# (default /var/cache/outbox-tools, outside the clone, so CI runs reuse it). The
# first install builds about 800 crates: 15-25 minutes on 2 cores, once per machine.
# Port: OUTBOX_TANSU_PORT (default 19092, not Kafka's 9092).

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

TANSU_VERSION=0.6.0

_tansu_fail() {
    echo "tansu.sh: $*" >&2
    return 1
}

_tansu_listening() { timeout 1 bash -c ">/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

_tansu_start() {
    local port="${OUTBOX_TANSU_PORT:-19092}"
    local tools="${OUTBOX_TOOLS_DIR:-/var/cache/outbox-tools}"
    export OUTBOX_TANSU_BROKERS="127.0.0.1:$port"
    TANSU_PID=""
    TANSU_LOG=""
    if _tansu_listening "$port"; then
        _tansu_fail "something already listens on 127.0.0.1:$port; stop it or set OUTBOX_TANSU_PORT"
        return 1
    fi
    local bin="$tools/bin/tansu"
    if [ ! -x "$bin" ] || ! "$bin" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
        echo "tansu.sh: installing tansu $TANSU_VERSION into $tools (first time on this machine: 15-25 min)" >&2
        mkdir -p "$tools" || { _tansu_fail "cannot create $tools"; return 1; }
        CARGO_TARGET_DIR="$tools/target" cargo install tansu --version "$TANSU_VERSION" \
            --locked --features dynostore --root "$tools" --quiet \
            || { _tansu_fail "cargo install tansu failed (see above)"; return 1; }
    fi
    TANSU_LOG="$(mktemp "${TMPDIR:-/tmp}/outbox-tansu.XXXXXX")"
    "$bin" broker --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine memory://tansu/ >"$TANSU_LOG" 2>&1 &
    TANSU_PID=$!
    if service_wait TANSU_PID 20 _tansu_listening "$port"; then
        echo "tansu.sh: tansu (pid $TANSU_PID) listens on $OUTBOX_TANSU_BROKERS" >&2
        return 0
    fi
    local why
    why="$(tail -n 3 "$TANSU_LOG" | tr '\n' ' ')"
    _tansu_stop
    _tansu_fail "tansu does not listen on 127.0.0.1:$port (its log: $why)"
}

_tansu_stop() {
    service_stop TANSU_PID
    if [ -n "${TANSU_LOG:-}" ]; then
        rm -f "$TANSU_LOG"
        TANSU_LOG=""
    fi
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # Sourced: start in the background and chain our cleanup to the caller's EXIT trap.
    service_sourced _tansu_start _tansu_stop || return 1
    return 0
fi
service_main tansu.sh _tansu_start _tansu_stop TANSU_PID OUTBOX_TANSU_BROKERS "$@"
