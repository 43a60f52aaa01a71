#!/bin/bash
# guest-ops.sh [ROUNDS]: vmhost's guest operations in real guests beside
# SSH (as root; uses the real-guest lane's artifacts, prepared if needed):
#
#   exec of `true`   `vmhost appvm exec` (the client) and the bare API
#                    request in an AppVM, beside `ssh` (a new connection,
#                    and a multiplexed one) in the lane's Debian guest
#   100 MiB copies   `vmhost appvm cp` in and out, beside `scp` in and out
#
# An AppVM has no sshd: the SSH side is the lane's classic Debian guest on
# the same kernel, qemu and host. ROUNDS (default 15) exec rounds, a third
# as many copy rounds (at least 3); the sides alternate, their order
# rotating each round; medians in ms. The test is TestRealGuestBench in
# e2e/realguest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
e2e/realguest/prepare.sh
out=$(mktemp)
trap 'rm -f "$out"' EXIT
VMHOST_REAL_GUESTS=1 VMHOST_LANE_BENCH=1 VMHOST_LANE_BENCH_ROUNDS=${1:-15} \
	go test -count=1 -v -timeout 60m -run '^TestRealGuestBench$' ./e2e/realguest/ >"$out" ||
	{ tail -100 "$out"; exit 1; }
# The report: its heading and its indented rows, printed by the test.
sed -n '/^guest operations, real guests/,/^[^ ]/p' "$out" | grep -v '^[-=]\|^PASS\|^ok'
