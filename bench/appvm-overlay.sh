#!/bin/bash
# appvm-overlay.sh [ROUNDS]: the cost of an AppVM's root disk made from its
# image's build, three ways, for builds of 10 MiB, 200 MiB and 1 GiB of data
# (random, every cluster allocated), each disk 4 GiB virtual:
#
#   qemu-img-create-b  `qemu-img create -f qcow2 -b BUILD -F qcow2` + fsync
#   CreateOverlay      vmhost's overlay writer (qcow2.CreateOverlay)
#   Copy               vmhost's full copy (disk.Copy, the copy mode)
#
# ROUNDS (default 9) rounds of all three, their order rotating each round;
# medians in ms. Then the blocks allocated by 100 overlays of one 1 GiB
# build, beside the build and 100 copies (computed from one).
#
# Both parts are Go benchmarks in disk/overlay_bench_test.go
# (BenchmarkRootDisk, BenchmarkOverlayDiskUse); this script runs them and
# prints a table. Run from the repository root; needs qemu-img. TMPDIR
# decides the file system measured.
set -euo pipefail
rounds=${1:-9}
cd "$(dirname "$0")/.."
go=${GO:-go}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "file system of ${TMPDIR:-/tmp}: $(df --output=fstype "${TMPDIR:-/tmp}" | tail -1); $rounds rounds"
"$go" test -run '^$' -bench '^BenchmarkRootDisk$' -benchtime "${rounds}x" ./disk >"$out"
printf '\n%-8s %20s %15s %10s %18s\n' build qemu-img-create-b CreateOverlay Copy Copy/CreateOverlay
# Lines look like: BenchmarkRootDisk/1GiB-2  9  123 ns/op  1.2 ms/CreateOverlay  950 ms/Copy  3.4 ms/qemu-img-create-b
awk '/^BenchmarkRootDisk\// {
	split($1, n, "/"); sub(/-[0-9]+$/, "", n[2])
	for (i = 3; i < NF; i++) m[$(i+1)] = $i
	printf "%-8s %17.2f ms %12.2f ms %7.1f ms %17.0fx\n", n[2], m["ms/qemu-img-create-b"], m["ms/CreateOverlay"], m["ms/Copy"], m["ms/Copy"] / m["ms/CreateOverlay"]
}' "$out"
"$go" test -run '^$' -bench '^BenchmarkOverlayDiskUse$' -benchtime 1x ./disk >"$out"
awk '/^BenchmarkOverlayDiskUse/ {
	for (i = 3; i < NF; i++) m[$(i+1)] = $i
	printf "\ndisk allocated (st_blocks): 1 GiB build %.1f MiB; 100 overlays of it %.1f MiB (%.0f KiB each); 100 copies %.1f GiB (computed from one)\n",
		m["build-bytes"] / 1048576, m["100-overlays-bytes"] / 1048576, m["100-overlays-bytes"] / 100 / 1024, m["100-copies-bytes(computed)"] / 1073741824
}' "$out"
