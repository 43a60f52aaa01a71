// Package seed builds the NoCloud seed disk that cloud-init reads at a
// classic VM's first boot: it renders meta-data, user-data and
// network-config from the VM's cloud_init request and nets, and writes them
// into a small FAT12 image labelled CIDATA (package seed/fat) without mkfs
// or mtools. Facts behind the choices: docs/ref/nocloud-seed.md.
//
// The package imports none of vmhost's other packages; the caller maps the
// API's cloud_init object and nets[] onto Config.
//
// # Documents
//
// meta-data holds instance-id and local-hostname. The instance-id is
// Config.InstanceID when given, else DefaultInstanceID(VMID) = "iid-" + the
// VM id: stable across reboots of one VM (so cloud-init does not re-run its
// per-instance modules) and distinct across VMs. The "iid-" prefix marks it
// as derived. The hostname defaults to DefaultHostname(VMID).
//
// user-data is #cloud-config. It sets hostname (plus manage_etc_hosts, so
// the name resolves for sudo) and one user: root by default (with
// disable_root: false, so root's keys are not prefixed with a "please log in
// as" command), or a named user with shell /bin/bash that gets
// "sudo: ALL=(ALL) NOPASSWD:ALL" only when Config.Sudo is true. The list
// replaces the image's default user. ssh_authorized_keys is written when
// there are keys. A password, when given, is plain_text_passwd with
// lock_passwd: false (lock_passwd defaults to true and would lock it again)
// and chpasswd expire: false (an expired password stops console auto-login
// at "You are required to change your password"). ssh_pwauth is not set:
// SSH password login stays the image's choice; the password is for the
// console. With ConsoleAutologin, a write_files drop-in replaces
// serial-getty@ttyS0's ExecStart with agetty --autologin USER (without -o,
// which would suppress agetty's -f), and runcmd runs systemctl daemon-reload
// and a --no-block restart of the getty, since systemd loaded the unit
// before cloud-init wrote the drop-in.
//
// network-config is version 2, one ethernets entry per interface matched
// by MAC with set-name. Interface 0 takes cloud_init.network, the others
// their own nets[i].ipv4/ipv6; a nil address means DHCP (dhcp4: true). When
// every interface uses DHCP no network-config is written at all, and
// cloud-init's fallback applies (DHCP on the first connected NIC).
//
// Default routes are written as the interface's gateway4 / gateway6, for
// both families, because that is the one form every cloud-init renderer
// (eni, netplan, networkd, sysconfig, network-manager) turns into a default
// route (checked with `cloud-init devel net-convert` by
// TestNetConvertDefaultRoute). The route form fails silently: for
// "routes: [{to: 0.0.0.0/0, via: GW}]" cloud-init 22.4 (Debian 12) writes
// "post-up route add default gw GW || true" with eni, which does nothing on
// a guest without net-tools (Debian's default), and it renders "to: ::/0"
// as ::/64 with eni, networkd, sysconfig and network-manager; "to: default"
// is an error there. Upstream logs gateway4/gateway6 as deprecated
// (removal scheduled for 27.4); the replacement that keeps working on every
// renderer is a network-config v1 static subnet's "gateway", which renders
// the same way (checked on 22.4). cloud-init's sysconfig renderer for the
// SUSE flavour writes no default route in any form (routes go to ifroute-*
// files it does not write, lp#1812117).
//
// # Quoting
//
// Every string value is a YAML double-quoted scalar with backslash escapes
// for quotes, backslashes, control characters and the Unicode line
// separators, so no value can end its field or start another. Config.Validate
// additionally refuses control characters in keys, password, user and
// instance-id (cloud-init feeds keys to authorized_keys and passwords to
// chpasswd line by line, where a newline would add an entry), requires a
// hostname that is a DNS label and a user name that is a valid Linux login
// (it also appears in the agetty drop-in). Errors never contain the
// password.
//
// # Image
//
// Write and WriteFile store the documents as a Size-byte (1 MiB) image with
// label CIDATA, timestamps fixed at the FAT epoch and a volume ID derived
// from the documents, so the same Config always gives the same bytes.
package seed
