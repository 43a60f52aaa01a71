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
# Then, as root, the same through the agent (simulators): an AppVM's
# create (POST /api/appvm/vms with auto_boot) until its display_state is
# running, for the three images, with appvm_root_disk overlay and copy,
# beside qemu-img create -b of the same build, ROUNDS rounds alternating
# the three; and the disk 100 AppVMs of one 1 GiB image take.
#
# The parts are Go benchmarks: disk/overlay_bench_test.go
# (BenchmarkRootDisk, BenchmarkOverlayDiskUse) and
# e2e/bench_overlay_test.go (BenchmarkAppVMCreate, BenchmarkAppVMDiskUse);
# this script runs them and prints tables. Run from the repository root;
# needs qemu-img. TMPDIR decides the file system measured.
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

# The same through the agent (as root: an AppVM has an interface, made in a
# network namespace): create to running, and the disk 100 AppVMs take.
if [ "$(id -u)" != 0 ]; then
	echo "not root: the agent benchmarks (e2e BenchmarkAppVMCreate, BenchmarkAppVMDiskUse) are skipped"
	exit 0
fi
"$go" test -run '^$' -bench '^BenchmarkAppVMCreate$' -benchtime "${rounds}x" -timeout 60m ./e2e >"$out"
printf '\nAppVM create to running, medians of %s rounds (ms)\n%-8s %10s %10s %18s\n' "$rounds" image overlay copy qemu-img-create-b
awk '/^BenchmarkAppVMCreate/ {
	for (i = 3; i < NF; i++) m[$(i+1)] = $i
	split("10MiB 200MiB 1GiB", sz, " ")
	for (k = 1; k <= 3; k++)
		printf "%-8s %10.1f %10.1f %18.1f\n", sz[k], m["ms/overlay-" sz[k]], m["ms/copy-" sz[k]], m["ms/qemu-img-create-b-" sz[k]]
	printf "overlay 1 GiB / 10 MiB: %.2f\n", m["overlay-1GiB/10MiB"]
}' "$out"
"$go" test -run '^$' -bench '^BenchmarkAppVMDiskUse$' -benchtime 1x -timeout 60m ./e2e >"$out"
awk '/^BenchmarkAppVMDiskUse/ {
	for (i = 3; i < NF; i++) m[$(i+1)] = $i
	printf "\n100 AppVMs of one 1 GiB image (st_blocks): build %.0f MiB + their directories %.1f MiB = %.3f GiB; with copies %.1f GiB (computed from one)\n",
		m["build-MiB"], m["100-overlay-AppVMs-MiB"], m["overlays+build-GiB"], m["100-copy-AppVMs-GiB(computed)"]
}' "$out"
