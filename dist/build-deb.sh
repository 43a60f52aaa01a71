#!/bin/sh
# build-deb.sh builds the vmhost Debian package with dpkg-deb alone (no
# debhelper): a static binary (CGO_ENABLED=0, -trimpath), the systemd unit,
# the default configuration as conffiles, the documentation and the manual
# page, and maintainer scripts that prepare the state directory and reload
# systemd but never start the agent on install.
#
# Usage: dist/build-deb.sh            (from anywhere in the repository)
# Environment:
#   VERSION     package and binary version (default: from git describe,
#               else 0~git<commit>; a leading v is dropped)
#   GOARCH      target architecture (default: go env GOARCH)
#   OUT         output directory (default: dist/out)
#   MAINTAINER  the control file's Maintainer
# Prints the path of the .deb on stdout.
set -eu

cd "$(dirname "$0")/.."
repo=$(pwd)

commit=$(git rev-parse HEAD 2>/dev/null || true)
if [ -z "${VERSION:-}" ]; then
	VERSION=$(git describe --tags --match 'v[0-9]*' 2>/dev/null | sed 's/^v//; s/-/+/; s/-/./' || true)
	[ -n "$VERSION" ] || VERSION="0~git$(printf '%.12s' "${commit:-unknown}")"
fi
VERSION=${VERSION#v}
case $VERSION in
[0-9]*) ;;
*) echo "build-deb.sh: VERSION $VERSION must start with a digit" >&2; exit 2 ;;
esac
GOARCH=${GOARCH:-$(go env GOARCH)}
OUT=${OUT:-$repo/dist/out}
MAINTAINER=${MAINTAINER:-vmhost maintainers <vmhost@vmhost.invalid>}
# Reproducible: file times and the changelog date come from the commit.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
export SOURCE_DATE_EPOCH

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
chmod 0755 "$root"
umask 022

CGO_ENABLED=0 GOOS=linux GOARCH=$GOARCH go build -trimpath -buildvcs=false \
	-ldflags "-s -w -X main.version=$VERSION -X main.commit=$commit" \
	-o "$root/usr/bin/vmhost" .

install -D -m 0644 dist/vmhost.service "$root/lib/systemd/system/vmhost.service"
# The default configuration is the built-in one, so an untouched file
# changes nothing (generated: it cannot drift from the config package).
install -d -m 0755 "$root/etc/vmhost"
go run -buildvcs=false . config default >"$root/etc/vmhost/config.json"
chmod 0644 "$root/etc/vmhost/config.json"
install -D -m 0644 dist/default "$root/etc/default/vmhost"
install -d -m 0755 "$root/usr/share/doc/vmhost"
gzip -9n <README.md >"$root/usr/share/doc/vmhost/README.md.gz"
# The guides and the API reference (docs/), as the README links them.
for f in docs/*.md docs/ref/*.md; do
	[ -e "$f" ] || continue
	dst="$root/usr/share/doc/vmhost/${f#docs/}.gz"
	install -d -m 0755 "$(dirname "$dst")"
	gzip -9n <"$f" >"$dst"
done
cat >"$root/usr/share/doc/vmhost/copyright" <<COPYRIGHT
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: vmhost

Files: *
Copyright: $(date -u -d "@$SOURCE_DATE_EPOCH" +%Y) the vmhost authors
License: proprietary
 Distributed with the appliance it runs on.
COPYRIGHT
# The manual page, made from the same command lines as vmhost help.
install -d -m 0755 "$root/usr/share/man/man1"
go run -buildvcs=false -ldflags "-X main.version=$VERSION" . man | gzip -9n >"$root/usr/share/man/man1/vmhost.1.gz"
# vmhost is one static binary by design (dropped on appliance and
# air-gapped hosts, and the /init of every AppVM: docs/design.md §1).
install -D -m 0644 /dev/stdin "$root/usr/share/lintian/overrides/vmhost" <<OVERRIDES
vmhost: statically-linked-binary [usr/bin/vmhost]
OVERRIDES
date=$(date -u -R -d "@$SOURCE_DATE_EPOCH")
{
	printf 'vmhost (%s) unstable; urgency=medium\n\n' "$VERSION"
	printf '  * Built from commit %s.\n\n' "${commit:-unknown}"
	printf ' -- %s  %s\n' "$MAINTAINER" "$date"
} | gzip -9n >"$root/usr/share/doc/vmhost/changelog.gz"

install -d -m 0755 "$root/DEBIAN"
printf '/etc/default/vmhost\n/etc/vmhost/config.json\n' >"$root/DEBIAN/conffiles"
install -m 0755 dist/postinst "$root/DEBIAN/postinst"
install -m 0755 dist/postrm "$root/DEBIAN/postrm"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<CONTROL
Package: vmhost
Version: $VERSION
Architecture: $GOARCH
Maintainer: $MAINTAINER
Installed-Size: $size
Depends: qemu-system-common, e2fsprogs
Suggests: cloud-hypervisor
Section: admin
Priority: optional
Description: per-host VM agent for Cloud Hypervisor VMs and AppVMs
 vmhost runs Cloud Hypervisor virtual machines on one host, with root
 disks served by qemu-storage-daemon, and serves an authenticated
 JSON/HTTP API (optionally over TLS and mutual TLS) for them. AppVMs run
 a container image as the workload of a small VM.
 .
 The same static binary is the operator's command-line client (vmhost list,
 vmhost vm, vmhost appvm, vmhost events, vmhost console) and checks a host
 (vmhost doctor). The service is installed but not started: add an API
 key, then systemctl enable --now vmhost. The guides and the API reference
 are in /usr/share/doc/vmhost.
 Cloud Hypervisor itself is not packaged here: install its static binary
 as /usr/bin/cloud-hypervisor or set binaries.cloud_hypervisor.
CONTROL

find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
mkdir -p "$OUT"
deb="$OUT/vmhost_${VERSION}_${GOARCH}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >&2
echo "$deb"
