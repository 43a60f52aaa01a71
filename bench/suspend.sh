#!/bin/bash
# suspend.sh [ROUNDS] [SIZES]: a suspend and a start from it through the
# agent, beside the same guest saved and restored by hand with QEMU and
# beside a cold boot (as root; uses the real-guest lane's artifacts,
# prepared if needed):
#
#   agent     POST suspend until 204; POST start until the guest's first
#             sign of life (a tick line it prints every 50 ms on its serial
#             port, read from the agent's console log)
#   by hand   the agent's own qemu argv: stop + migrate to a file + quit;
#             qemu -incoming + cont until the first tick (serial socket)
#   by hand as the backend
#             the same with the file passed to qemu (migrate to fd:,
#             -incoming fd:), as the simulator's qemu backend does it
#   cold      POST start of the stopped VM until the first tick; then a
#             suspend of the guest just booted, shown apart (qemu's
#             migration allocates every page a new guest never touched),
#             and a start from it, so that every round suspends guests
#             restored from their previous save on both sides
#
# plus the saved state's bytes per GiB of guest memory on both sides and
# the agent's share ((agent - by hand) / agent). The guest is the lane's
# cloud kernel with a busybox initramfs booted by OVMF (as the lane's
# classic guest), a quarter of its memory filled with random data.
# ROUNDS (default 5) rounds per size, the four sides' order rotating each
# round; SIZES (MiB, default 256,1024); medians in ms, with the load
# average. VMHOST_SUSPEND_BENCH_JAIL=off runs the agent's VMs unconfined.
# The test is TestRealGuestSuspendBench in e2e/realguest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
e2e/realguest/prepare.sh
out=$(mktemp)
trap 'rm -f "$out"' EXIT
VMHOST_REAL_GUESTS=1 VMHOST_SUSPEND_BENCH=1 VMHOST_SUSPEND_BENCH_ROUNDS=${1:-5} VMHOST_SUSPEND_BENCH_SIZES=${2:-256,1024} \
	go test -count=1 -v -timeout 120m -run '^TestRealGuestSuspendBench$' ./e2e/realguest/ >"$out" ||
	{ tail -150 "$out"; exit 1; }
# The report: its heading and its indented rows, printed by the test.
sed -n '/^suspend and start from it, real guests/,/^[^ ]/p' "$out" | grep -v '^[-=]\|^PASS\|^ok'
