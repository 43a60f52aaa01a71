#!/bin/bash
# hostile-clients.sh [ITERATIONS]: a keyed client's GET /api/vms while one
# source holds 1,000 idle, /healthz-and-idle and slowloris connections
# against the agent, beside the same request to an agent without hostile
# load, alternated (BenchmarkHostileClients in package main; see its doc).
# Prints the median and p99 of both sides in ms, the failed requests and
# the hostile connects per second.
#
#   bench/hostile-clients.sh 300
#   VMHOST_BENCH_BINARY=/tmp/vmhost-old bench/hostile-clients.sh   # another build
#
# Environment: VMHOST_BENCH_HOSTILE (connections, default 1000),
# VMHOST_BENCH_RECONNECT_MS (pause before a closed one reconnects,
# default 100), VMHOST_BENCH_BINARY.
set -euo pipefail
n=${1:-200}
cd "$(dirname "$0")/.."
# The hostile side holds a descriptor per connection.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
exec go test -run '^$' -bench '^BenchmarkHostileClients$' -benchtime "${n}x" -count 1 .
