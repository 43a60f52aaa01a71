#!/usr/bin/env bash
# One-time check of the render goldens against an installed cloud-init
# (apt-get install cloud-init; Debian 12 ships 22.4.2). Not run by CI.
# Usage, from the repository root: seed/testdata/cloud-init-check.sh > seed/testdata/cloud-init-check.log 2>&1
set -uo pipefail
cd "$(dirname "$0")/.."  # seed/
export PATH=/usr/local/go/bin:$PATH LC_ALL=C.UTF-8
imgs=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$imgs" "$out"' EXIT

echo "# cloud-init $(dpkg-query -W -f='${Version}' cloud-init 2>/dev/null), $(date -u +%F)"
go test -count=1 -run TestWriteFileEndToEnd -image-dir "$imgs" . >/dev/null || { echo "go test failed"; exit 1; }

for d in testdata/render/*/; do
	d=${d%/}
	echo
	echo "## $(basename "$d")"
	echo "\$ cloud-init schema --config-file $d/user-data"
	cloud-init schema --config-file "$d/user-data" 2>&1
	echo "[exit $?]"
	if [ -f "$d/network-config" ]; then
		for r in networkd eni netplan; do
			rm -rf "$out"/*
			echo "\$ cloud-init devel net-convert -p $d/network-config -k yaml -D debian -O $r -d OUT"
			cloud-init devel net-convert -p "$d/network-config" -k yaml -D debian -O "$r" -d "$out" >/dev/null 2>"$out.err"
			rc=$?
			grep -v '^Wrote output format' "$out.err"
			echo "[exit $rc] rendered addresses, routes and gateways:"
			case $r in
			networkd) grep -h -E '^(Name|Address|Destination|Gateway|DHCP|DNS)=' "$out"/etc/systemd/network/*.network ;;
			eni) grep -h -E '^(iface|auto)|address |gateway |route add|dns-nameservers' "$out"/etc/network/interfaces.d/50-cloud-init ;;
			netplan) grep -h -E 'to:|via:|gateway[46]:|addresses:|- |set-name' "$out"/etc/netplan/50-cloud-init.yaml ;;
			esac | sed 's/^/    /'
		done
		rm -f "$out.err"
	fi
	echo "\$ testdata/nocloud_read.py IMAGE $d   # DataSourceNoCloud._get_data() on the image the seed package wrote"
	/usr/bin/python3 testdata/nocloud_read.py "$imgs/$(basename "$d").img" "$d" 2>&1
	echo "[exit $?]"
done

# Contrast for the package's IPv6 default-route choice: the dual-stack golden
# with gateway6 replaced by the route form "to: ::/0".
echo
echo "## contrast: static-dual-stack-multi-nic with routes: [{to: \"::/0\"}] instead of gateway6"
sed -e 's/^    gateway6: "2001:db8:10::1"$/    routes:\n      - to: "::\/0"\n        via: "2001:db8:10::1"/' \
	testdata/render/static-dual-stack-multi-nic/network-config >"$imgs/v6-route.yaml"
grep -n -B3 -A1 '::/0' "$imgs/v6-route.yaml" | sed 's/^/    /'
for r in networkd eni; do
	rm -rf "$out"/*
	echo "\$ cloud-init devel net-convert -p v6-route.yaml -k yaml -D debian -O $r -d OUT"
	cloud-init devel net-convert -p "$imgs/v6-route.yaml" -k yaml -D debian -O "$r" -d "$out" >/dev/null 2>&1
	echo "[exit $?] IPv6 routes:"
	cat "$out"/etc/systemd/network/*.network "$out"/etc/network/interfaces.d/50-cloud-init 2>/dev/null | grep -E 'Destination=::|inet6 ::|2001:db8:10::1' | sed 's/^/    /'
done
