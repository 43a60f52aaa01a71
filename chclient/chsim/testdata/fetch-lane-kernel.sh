#!/bin/sh
# Fetch Debian's cloud kernel for the qemu backend's real-guest tests (qemu_test.go) and
# unpack it under /var/cache/vmhost-lane/linux-image-cloud (boot/vmlinuz-*, lib/modules/*).
# The tests find it there, or wherever VMHOST_LANE_KERNEL points. Nothing is installed.
#
# usage: fetch-lane-kernel.sh [DEST]      (DEST defaults to /var/cache/vmhost-lane)
set -eu
dest=${1:-/var/cache/vmhost-lane}
if ls "$dest"/linux-image-cloud/boot/vmlinuz-* >/dev/null 2>&1; then
	ls "$dest"/linux-image-cloud/boot/vmlinuz-*
	exit 0
fi
# The versioned package the meta-package linux-image-cloud-amd64 depends on.
pkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1)
if [ -z "$pkg" ]; then
	echo "fetch-lane-kernel: cannot resolve linux-image-cloud-amd64 (apt-get update?)" >&2
	exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q "$pkg" >&2)
mkdir -p "$dest"
rm -rf "$dest/linux-image-cloud.tmp"
dpkg-deb -x "$work"/"$pkg"_*.deb "$dest/linux-image-cloud.tmp"
rm -rf "$dest/linux-image-cloud"
mv "$dest/linux-image-cloud.tmp" "$dest/linux-image-cloud"
ls "$dest"/linux-image-cloud/boot/vmlinuz-*
