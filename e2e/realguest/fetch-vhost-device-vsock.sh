#!/bin/sh
# Fetch vhost-device-vsock (rust-vmm; packaged only in Debian unstable) without touching the
# system's apt sources: apt runs with a configuration of its own (its own sources list, lists
# and cache directories; the system's dpkg status so nothing is "missing"), downloads the one
# .deb and unpacks it with dpkg-deb -x. The binary runs on bookworm (it needs libc6 >= 2.34).
#
# usage: fetch-vhost-device-vsock.sh [DEST]      (DEST defaults to /var/cache/vmhost-lane)
# Prints the binary's path. Idempotent: an existing binary is kept.
# The binary is never committed; the chsim qemu backend takes it by --sim-vsock-backend.
set -eu

dest=${1:-/var/cache/vmhost-lane}
mirror=${VMHOST_DEBIAN_MIRROR:-http://deb.debian.org/debian}
bin=$dest/vhost-device-vsock/usr/bin/vhost-device-vsock

if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

apt_dir=$dest/apt-unstable
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.list.d" "$apt_dir/preferences.d"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror unstable main" >"$apt_dir/sources.list"

apt_own() {
	apt-get -q \
		-o Dir::Etc::SourceList="$apt_dir/sources.list" \
		-o Dir::Etc::SourceParts="$apt_dir/sources.list.d" \
		-o Dir::Etc::PreferencesParts="$apt_dir/preferences.d" \
		-o Dir::State::Lists="$apt_dir/lists" \
		-o Dir::Cache="$apt_dir/cache" \
		-o Dir::State::status=/var/lib/dpkg/status \
		-o APT::Sandbox::User=root \
		"$@"
}

apt_own update >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt_own download vhost-device-vsock >&2)
deb=$(ls "$work"/vhost-device-vsock_*.deb)
rm -rf "$dest/vhost-device-vsock"
dpkg-deb -x "$deb" "$dest/vhost-device-vsock"
# The lists are large and only needed for this one download.
rm -rf "$apt_dir/lists" "$apt_dir/cache"
test -x "$bin"
echo "$bin"
