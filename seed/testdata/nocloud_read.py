#!/usr/bin/python3
"""Let cloud-init's own NoCloud datasource read a seed image written by the
seed package, and compare what it got with the render goldens.

Usage: nocloud_read.py IMAGE GOLDEN_DIR

Runs against the installed cloud-init (22.4.2 on Debian 12). Two stand-ins,
because an image file is not a block device and vfat cannot be loop-mounted
in the sandbox: device discovery calls the real `blkid` with the
datasource's exact criteria on the image file (path=IMAGE, no cache), and
the mount is replaced by extracting the root directory with `mcopy`.
Everything else (label matching, required/optional files, YAML loading of
meta-data and network-config) is cloud-init's code.
"""
import os
import subprocess
import sys
import tempfile

from cloudinit import helpers, util
from cloudinit.sources import DataSourceNoCloud as nocloud

img, golden = sys.argv[1], sys.argv[2]

real_find = util.find_devs_with


def find_devs_with(criteria=None, **_):
    return real_find(criteria, no_cache=True, path=img)


def mount_cb(dev, callback, data=None, **_):
    with tempfile.TemporaryDirectory() as mnt:
        subprocess.run(["mcopy", "-n", "-i", dev, "::*", mnt + "/"], check=True)
        return callback(mnt, data)


util.find_devs_with = find_devs_with
util.mount_cb = mount_cb
nocloud.dmi.read_dmi_data = lambda key: None

with tempfile.TemporaryDirectory() as tmp:
    paths = helpers.Paths({"cloud_dir": tmp, "run_dir": tmp})
    ds = nocloud.DataSourceNoCloud(sys_cfg={}, distro=None, paths=paths)
    if not ds._get_data():
        sys.exit("FAIL: NoCloud did not claim " + img)


def read(name):
    p = os.path.join(golden, name)
    if not os.path.exists(p):
        return None
    with open(p, "rb") as f:
        return f.read()


problems = []
want_md = util.load_yaml(read("meta-data"))
for key in ("instance-id", "local-hostname"):
    if ds.metadata.get(key) != want_md[key]:
        problems.append("meta-data %s = %r, want %r" % (key, ds.metadata.get(key), want_md[key]))
if ds.userdata_raw != read("user-data"):
    problems.append("user-data differs from the golden")
nc = read("network-config")
want_nc = util.load_yaml(nc) if nc is not None else None
if ds.network_config != want_nc:
    problems.append("network-config = %r, want %r" % (ds.network_config, want_nc))
if problems:
    sys.exit("FAIL: " + "; ".join(problems))
print(
    "OK seed=%s instance-id=%r user-data=%d bytes identical network-config=%s"
    % (
        os.path.basename(ds.seed),
        ds.metadata["instance-id"],
        len(ds.userdata_raw),
        "none (fallback DHCP)"
        if want_nc is None
        else "v%d ethernets %s" % (want_nc["version"], sorted(want_nc["ethernets"])),
    )
)
