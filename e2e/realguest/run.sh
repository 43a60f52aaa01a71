#!/bin/bash
# Run the real-guest lane alone (as root): prepare the artifacts (cached in
# /var/cache/vmhost-lane, or VMHOST_LANE_CACHE), then the lane test, which
# fails instead of skipping when anything it needs is missing. Extra
# arguments go to `go test` (for example -run or -v is already on).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=/usr/local/go/bin:$PATH
start=$(date +%s)
e2e/realguest/prepare.sh
echo "lane phase prepare (total)        $(($(date +%s) - start)) s" >&2
VMHOST_REAL_GUESTS=1 go test -count=1 -v -parallel 4 -timeout 15m -run '^TestRealGuests$' "$@" ./e2e/realguest/
# The guest agent's own real-kernel test: exec on a pseudo-terminal, files,
# signals over AF_VSOCK in a real guest.
VMHOST_REAL_GUESTS=1 go test -count=1 -v -timeout 10m -run '^TestQemuOperations$' ./appvm/guest/
echo "lane total (prepare + test)       $(($(date +%s) - start)) s" >&2
