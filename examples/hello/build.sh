#!/bin/sh
# build.sh OUT.tar builds the hello workload (a static Go program, beside
# this script) and packs it, alone, as an OCI image layout in a tar: the
# image `vmhost image import` takes. It needs Go, tar and sha256sum.
set -eu
out=${1:?usage: examples/hello/build.sh OUT.tar}
case $out in /*) ;; *) out=$(pwd)/$out ;; esac
cd "$(dirname "$0")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rootfs" "$work/layout/blobs/sha256"
arch=$(go env GOARCH)
CGO_ENABLED=0 go build -trimpath -o "$work/rootfs/hello" .

# blob FILE MEDIATYPE: store FILE by its digest and print its descriptor.
blob() {
	digest=$(sha256sum "$1" | cut -d' ' -f1)
	size=$(wc -c <"$1")
	mv "$1" "$work/layout/blobs/sha256/$digest"
	printf '{"mediaType":"%s","digest":"sha256:%s","size":%d}' "$2" "$digest" "$size"
}

# One layer: the program, owned by root, with fixed times.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/rootfs" -cf "$work/layer.tar" hello
diff_id=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
layer=$(blob "$work/layer.tar" application/vnd.oci.image.layer.v1.tar)
printf '{"architecture":"%s","os":"linux","config":{"Entrypoint":["/hello"],"Env":["GREETING=hello"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
	"$arch" "$diff_id" >"$work/config.json"
config=$(blob "$work/config.json" application/vnd.oci.image.config.v1+json)
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":%s,"layers":[%s]}' \
	"$config" "$layer" >"$work/manifest.json"
manifest=$(blob "$work/manifest.json" application/vnd.oci.image.manifest.v1+json)
printf '{"schemaVersion":2,"manifests":[%s]}' "$manifest" >"$work/layout/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$work/layout/oci-layout"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$work/layout" -cf "$out" .
echo "$out"
