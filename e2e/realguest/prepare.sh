#!/bin/bash
# Prepare the real-guest lane (run as root; idempotent). Installs what the lane
# needs and builds, once per machine, into the cache directory
# (VMHOST_LANE_CACHE, default /var/cache/vmhost-lane):
#
#   guest/<key>/debian.qcow2   Debian bookworm classic guest: GPT, root ext4 on
#                              vda1, an EFI system partition (vda2) with
#                              systemd-boot loading the guest's own kernel and
#                              initrd (vmhost's classic VMs take no initrd, so
#                              they boot it with firmware_path = OVMF)
#   guest/<key>/vmlinuz, initrd.img   the same kernel and initrd, for -kernel/-initrd by hand
#   guest/<key>/cloud-kernel/  Debian's cloud kernel from the guest: vmlinuz and
#                              lib/modules/<version> (appvm_kernel, appvm_modules)
#   vhost-device-vsock/usr/bin/vhost-device-vsock   (fetch-vhost-device-vsock.sh)
#   current                    symlink to guest/<key>
#
# <key> hashes the package list and the build steps (this file), so a change
# of either builds a new guest; older guests are removed. Each phase's time is
# printed on stderr. The OVMF firmware is /usr/share/ovmf/OVMF.fd (apt).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${VMHOST_LANE_CACHE:-/var/cache/vmhost-lane}
mirror=${VMHOST_DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" != 0 ]; then
	echo "prepare.sh: must run as root (apt, debootstrap, chroot)" >&2
	exit 1
fi

phase_start=0
phase() { phase_name=$1; phase_start=$(date +%s.%N); }
phase_end() {
	printf 'lane phase %-22s %6.1f s\n' "$phase_name" "$(echo "$(date +%s.%N) - $phase_start" | bc)" >&2
}

# Host packages. qemu-system-x86: the guests' hypervisor; qemu-system-common:
# qemu-storage-daemon; ovmf: firmware of the classic guest; systemd-boot-efi:
# its boot loader; debootstrap, fdisk (sfdisk), dosfstools, mtools,
# e2fsprogs: the image build without loop devices; dnsmasq-base: DHCP on the
# lane's bridge; openssh-client: checks in the guest; busybox-static: the
# AppVM image's root; bc: phase times.
host_packages="qemu-system-x86 qemu-system-common qemu-utils ovmf systemd-boot-efi debootstrap
	fdisk dosfstools mtools e2fsprogs dnsmasq-base openssh-client busybox-static iproute2 bc
	ca-certificates"

# Guest packages (docs/ref/real-guests.md §4): python3-cffi-backend named
# because debootstrap does not resolve the virtual dependency of cloud-init.
guest_packages="systemd-sysv udev cloud-init python3-cffi-backend openssh-server
	linux-image-cloud-amd64 initramfs-tools ifupdown isc-dhcp-client iproute2 e2fsprogs sudo
	netbase dbus kmod locales resolvconf"

phase apt
export DEBIAN_FRONTEND=noninteractive
missing=
for p in $host_packages; do
	dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || missing="$missing $p"
done
if [ -n "${missing// /}" ]; then
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends $host_packages >/dev/null
fi
phase_end

mkdir -p "$cache"

phase vhost-device-vsock
"$here/fetch-vhost-device-vsock.sh" "$cache" >/dev/null
phase_end

key=$( (echo "$guest_packages" | tr -s ' \t\n' '\n' | sort; cat "$0") | sha256sum | cut -c1-16)
out=$cache/guest/$key
if [ -f "$out/done" ]; then
	echo "guest image cached: $out" >&2
	ln -sfn "guest/$key" "$cache/current"
	exit 0
fi
rm -rf "$cache/guest"
mkdir -p "$out"
work=$cache/work
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT

phase debootstrap
# dpkg in the new root skips its fsyncs (the image is built from the tree
# afterwards; a crash just rebuilds it); the setting is removed below.
mkdir -p "$work/root/etc/dpkg/dpkg.cfg.d"
echo force-unsafe-io >"$work/root/etc/dpkg/dpkg.cfg.d/vmhost-lane-unsafe-io"
debootstrap --variant=minbase --include="$(echo $guest_packages | tr ' ' ',')" \
	bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
	{ tail -30 "$work/debootstrap.log" >&2; exit 1; }
phase_end

phase configure
root=$work/root
rm "$root/etc/dpkg/dpkg.cfg.d/vmhost-lane-unsafe-io"
sed -i 's/^# *en_US.UTF-8 UTF-8/en_US.UTF-8 UTF-8/' "$root/etc/locale.gen"
chroot "$root" locale-gen >/dev/null
echo 'LANG=en_US.UTF-8' >"$root/etc/default/locale"
cat >"$root/etc/fstab" <<'EOF'
/dev/vda1 / ext4 rw,errors=remount-ro 0 1
EOF
# NoCloud only: no time lost probing other clouds' metadata services.
# Host keys: ed25519 only (RSA generation takes tens of seconds under TCG).
cat >"$root/etc/cloud/cloud.cfg.d/90-vmhost-lane.cfg" <<'EOF'
datasource_list: [NoCloud, None]
ssh_genkeytypes: [ed25519]
EOF
# e2scrub_reap only cleans up e2scrub snapshots (LVM): none here.
ln -sf /dev/null "$root/etc/systemd/system/e2scrub_reap.service"
grep -q 'interfaces.d' "$root/etc/network/interfaces" 2>/dev/null ||
	printf 'auto lo\niface lo inet loopback\nsource /etc/network/interfaces.d/*\n' >"$root/etc/network/interfaces"
# Identity comes from the first boot: machine id, ssh host keys.
: >"$root/etc/machine-id"
rm -f "$root"/etc/ssh/ssh_host_*
rm -f "$root/var/lib/dbus/machine-id"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/*
kver=$(basename "$(ls -d "$root"/lib/modules/*)")
cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
mkdir -p "$out/cloud-kernel/lib/modules"
cp "$root/boot/vmlinuz-$kver" "$out/cloud-kernel/vmlinuz"
cp -a "$root/lib/modules/$kver" "$out/cloud-kernel/lib/modules/"
echo "$kver" >"$out/kernel-version"
phase_end

phase image
# Root: ext4 filled from the tree (no loop device). ESP: FAT with
# systemd-boot as the removable-media loader, kernel and initrd, no timeout.
# no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer check
# can miss its ticks and panic ("IO-APIC + timer doesn't work!"), as seen here.
root_mib=2048
esp_mib=64
mkfs.ext4 -q -F -L root -d "$root" "$work/root.img" "${root_mib}M" >/dev/null
mkfs.vfat -n ESP -C "$work/esp.img" $((esp_mib * 1024)) >/dev/null
export MTOOLS_SKIP_CHECK=1
mmd -i "$work/esp.img" ::/EFI ::/EFI/BOOT ::/loader ::/loader/entries
mcopy -i "$work/esp.img" /usr/lib/systemd/boot/efi/systemd-bootx64.efi ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$work/esp.img" "$out/vmlinuz" ::/vmlinuz
mcopy -i "$work/esp.img" "$out/initrd.img" ::/initrd.img
printf 'default debian.conf\ntimeout 0\n' >"$work/loader.conf"
printf 'title Debian\nlinux /vmlinuz\ninitrd /initrd.img\noptions console=ttyS0 root=/dev/vda1 rw no_timer_check\n' >"$work/debian.conf"
mcopy -i "$work/esp.img" "$work/loader.conf" ::/loader/loader.conf
mcopy -i "$work/esp.img" "$work/debian.conf" ::/loader/entries/debian.conf
disk=$work/disk.raw
truncate -s $((1 + root_mib + esp_mib + 1))M "$disk"
sfdisk -q "$disk" <<EOF
label: gpt
start=1MiB, size=${root_mib}MiB, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name=root
size=${esp_mib}MiB, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=esp
EOF
dd if="$work/root.img" of="$disk" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$work/esp.img" of="$disk" bs=1M seek=$((1 + root_mib)) conv=notrunc,sparse status=none
qemu-img convert -f raw -O qcow2 "$disk" "$out/debian.qcow2"
phase_end

touch "$out/done"
ln -sfn "guest/$key" "$cache/current"
echo "guest image built: $out" >&2
