#!/usr/bin/env bash
# Go and the Go libraries of the non-Rust example (examples/go-orders: database/sql
# with lib/pq, and nats.go), from Debian's packages: nothing is downloaded by Go
# itself. Installs what is missing (apt-get, updating the package index once if the
# packages are not found), then exports what the test that builds the example reads:
#
#   OUTBOX_GO       the go command
#   OUTBOX_GOPATH   Debian's Go library tree (GOPATH mode, GO111MODULE=off)
#
#   source scripts/go.sh          # as scripts/test.sh does
#
# Fails with one line naming what is missing when it cannot be had.

# shellcheck source=scripts/service.sh
source "$(dirname "${BASH_SOURCE[0]}")/service.sh"

_go_fail() {
    echo "go.sh: $*" >&2
    return 1
}

_go_setup() {
    local gopath=/usr/share/gocode
    local packages=(golang-go golang-github-lib-pq-dev golang-github-nats-io-go-nats-dev)
    local libraries=("$gopath/src/github.com/lib/pq" "$gopath/src/github.com/nats-io/nats.go")
    service_install_debian go.sh "${packages[@]}" || return 1
    local go
    go=$(command -v go || echo /usr/lib/go/bin/go)
    [ -x "$go" ] || { _go_fail "FAILED: no go command after installing golang-go"; return 1; }
    local library
    for library in "${libraries[@]}"; do
        [ -d "$library" ] || { _go_fail "FAILED: $library is missing (Debian packages ${packages[*]})"; return 1; }
    done
    export OUTBOX_GO="$go" OUTBOX_GOPATH="$gopath"
}

_go_setup
