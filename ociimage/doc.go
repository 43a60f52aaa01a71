// Package ociimage imports a container image from a file on the host into
// an ext4 root file system stored as qcow2, for AppVMs. It works offline:
// the image arrives as an OCI image layout (a directory or a tar of one) or
// as a `docker save` tarball, never from a registry.
//
// Import resolves the manifest, verifies every blob against its sha256
// digest (and size, where the descriptor gives one) and every layer's
// uncompressed stream against the config's rootfs.diff_ids while reading
// them, applies the layers in order into a staging directory, runs
// `mkfs.ext4 -d` over it and converts the result with qcow2.ConvertRaw. The
// image config's entrypoint, cmd, env, working directory, user and health
// check come back in Image as the workload defaults.
//
// # Sources
//
//   - OCI image layout: a directory, or a tar of one, holding oci-layout,
//     index.json and blobs/sha256/…. Nested indexes are followed. Among
//     several manifests, Options.Ref picks one by its ref-name annotation;
//     otherwise the one for Options.Platform (default linux/GOARCH), or the
//     only one. build_digest is the manifest's digest.
//   - `docker save` tarball: manifest.json with Config and Layers. Newer
//     Docker (25+) also writes index.json; then the OCI route is taken.
//     Older tarballs carry no manifest, so BuildDigest is the config's
//     digest (Docker's image id), which changes whenever the image does.
//     Layers named by a blobs/sha256/<hex> path are checked against that
//     digest, legacy <id>/layer.tar files against the config's diff_ids.
//   - A source, and every file read from a layout directory, must be a
//     directory or a regular file: a fifo, socket or device is refused
//     with ErrInvalid before it is opened (and files are opened with
//     O_NONBLOCK), so no source can block an import.
//   - The outer archive may be gzip-compressed; it is then decompressed
//     into the import's temp dir first.
//
// # Layers
//
// Layers may be plain tar or gzip (detected from the bytes, not the media
// type). zstd-compressed layers are refused with ErrUnsupported: the
// standard library has no zstd decoder. Layers are applied like the OCI
// image spec's changesets: `.wh.<name>` removes name from lower layers,
// `.wh..wh..opq` empties its directory of everything lower layers put there.
// Owners (lchown), modes including setuid, setgid and sticky, mtimes,
// symlinks, hard links (to any earlier entry of the merged tree), device
// nodes, fifos, and SCHILY.xattr.* extended attributes on regular files and
// directories are kept. Directory times are set once their layer is done;
// a directory that a layer changes without an entry of its own keeps them.
//
// # Safety
//
// The staging tree is only ever touched through an os.Root and *at system
// calls on the final path component with AT_SYMLINK_NOFOLLOW, so nothing is
// created, changed or removed outside it. An entry is refused, and the import
// fails with ErrUnsafePath, when its path is absolute, when it climbs out
// with "..", or when reaching its parent would follow a symlink out of the
// root. Absolute symlink targets count as leaving the root: a layer holding
// `etc -> /etc` and then `etc/passwd` fails. Symlinks that stay inside
// (`lib -> usr/lib`) are followed. Real image builders emit none of the
// refused forms. The source archive is read by name lookup in an index of
// it, never extracted, so its own paths cannot escape either.
//
// # Limits
//
// Against archives that unpack to far more than they weigh, an import
// fails with ErrLimit, naming the limit, as soon as the uncompressed layer
// streams together pass Options.MaxBytes (default 16 GiB; a regular file
// whose header alone would pass it is refused before any of it is
// written), or their entries pass Options.MaxEntries (default 1,000,000).
// A gzip-compressed source archive is held to MaxBytes as it is
// decompressed, and its own entries to MaxEntries. A path deeper than
// MaxPathDepth (256) components or longer than MaxPathBytes (4,096) is
// refused: entry names as they are applied, and the whole tree (which
// symlinked directories can make deeper than any name) before mkfs.ext4
// sees it.
//
// On failure, everything Import wrote (a temp dir .import-* under dstDir,
// and dstDir itself when Import created it) is removed (after a crash,
// RemoveStale does it), and the error names
// the cause: a digest mismatch, a missing blob, a truncated archive, an
// unsafe path, an unsupported compression. It matches the sentinel errors
// below with errors.Is.
//
// # Privileges
//
// Keeping owners needs CAP_CHOWN and creating character and block devices
// needs CAP_MKNOD, so Import normally runs as root (vmhost serve does). As
// another user it fails on the first owner or device it cannot set, unless
// Options.IgnoreOwners (files then belong to the importing user) or
// Options.SkipDevices (such device nodes are left out and counted in
// Image.SkippedDevices) say otherwise. Fifos need no privilege.
//
// # Size
//
// The ext4 file system gets one inode per entry of the staging tree plus a
// quarter more (at least 4096) for the workload, passed as mkfs -N since
// mkfs's own ratio runs short on trees of many small files. Its size is
// the bytes of every regular file and symlink rounded up to 4 KiB blocks
// (hard-linked inodes once), one block per directory and 256 bytes per
// inode, plus a fifth of that and 64 MiB of headroom for journal and
// metadata, rounded up to 1 MiB. Image.SizeBytes is that virtual size; the
// qcow2 file holds only the clusters in use. The caller grows the disk for
// a VM as it would any base image. While importing, the temp dir needs
// room for about twice the unpacked image (staging tree, then raw ext4).
//
// mkfs.ext4 (e2fsprogs 1.43 or newer, for -d) must be on PATH or in
// /usr/sbin or /sbin, or named in Options.Mkfs.
package ociimage
