// Package fat writes and reads small FAT12 images with long file names, the
// on-disk form of a cloud-init NoCloud seed ("cidata" volume).
//
// The writer builds the whole image in memory without mkfs.vfat or mtools.
// Its layout is the one mkfs.vfat chooses for the same size (see
// docs/ref/nocloud-seed.md §4): 512-byte sectors, 4 sectors per cluster,
// 1 reserved sector, 2 identical FATs, 512 root-directory entries, media
// 0xF8, 16 sectors per track and 2 heads. For a 1 MiB image with volume ID
// 0x1234ABCD and the same timestamps, the result equals
// `mkfs.vfat --invariant` + `mcopy` byte for byte except the OEM name, the
// boot code and the volume-label entry's timestamps.
//
// Limits:
//   - Files live in the root directory only; there are no subdirectories.
//   - Every file gets VFAT long-name entries plus a generated short alias
//     (first characters of the name, upper-cased, "~N"), as mtools does for
//     names such as "meta-data".
//   - Names are 1 to 255 UTF-16 code units of valid UTF-8, without control
//     characters, the characters * ? < > | " : / \, or a trailing dot or
//     space, and unique ignoring case (the Linux vfat driver compares names
//     case-insensitively).
//   - The image size is a multiple of 2048 bytes between MinSize and
//     MaxSize, so the volume is always FAT12 with a comfortable margin below
//     the 4084-cluster boundary where the kernel, fsck.fat and blkid
//     disagree.
//   - Files that need more root entries or more clusters than the image has
//     are rejected with an error wrapping ErrNoSpace; nothing is truncated.
//
// Knobs (Options): the image size, the volume label (default "CIDATA", the
// label cloud-init looks for), the volume ID (default: derived from the
// files, so identical input gives identical bytes) and the timestamp stamped
// on every entry (default 1980-01-01 00:00:00, the FAT epoch, so the image
// says nothing about when it was built).
//
// Build returns the whole image as a byte slice; Write streams it to an
// io.Writer with only the used part in memory; WriteSparse writes only the
// used part into a file and sets its size, so the rest is a hole.
//
// Read parses images this package writes (and ordinary FAT12/16 root
// directories in general) and returns every file; tests use it to read the
// bytes back.
package fat
