package kmod

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// KernelRelease returns the release ("6.1.0-56-cloud-amd64") of the kernel
// image at path: from the kernel_version string of a bzImage's setup header,
// or from the "Linux version " banner of any other image (an ELF vmlinux).
func KernelRelease(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("reading the kernel release: %w", err)
	}
	defer f.Close()
	rel, err := bzImageRelease(f)
	if err == nil {
		return rel, nil
	}
	if !errors.Is(err, errNotBzImage) {
		return "", fmt.Errorf("reading the kernel release of %s: %w", path, err)
	}
	rel, err = bannerRelease(f)
	if err != nil {
		return "", fmt.Errorf("reading the kernel release of %s: %w", path, err)
	}
	return rel, nil
}

var errNotBzImage = errors.New("not a bzImage")

// bzImageRelease reads the x86 boot protocol header: "HdrS" at 0x202, the
// protocol version at 0x206, and at 0x20e the offset (minus 0x200) of the
// NUL-terminated kernel_version string, whose first word is the release.
func bzImageRelease(r io.ReaderAt) (string, error) {
	var hdr [0x210]byte
	if _, err := r.ReadAt(hdr[:], 0); err != nil {
		return "", errNotBzImage
	}
	if string(hdr[0x202:0x206]) != "HdrS" {
		return "", errNotBzImage
	}
	if binary.LittleEndian.Uint16(hdr[0x206:]) < 0x0200 {
		return "", errors.New("boot protocol older than 2.00 has no kernel_version")
	}
	ptr := binary.LittleEndian.Uint16(hdr[0x20e:])
	if ptr == 0 {
		return "", errors.New("the bzImage header has no kernel_version")
	}
	var s [256]byte
	n, err := r.ReadAt(s[:], int64(ptr)+0x200)
	if n == 0 {
		return "", fmt.Errorf("reading kernel_version: %w", err)
	}
	str := s[:n]
	if i := bytes.IndexByte(str, 0); i >= 0 {
		str = str[:i]
	}
	f := bytes.Fields(str)
	if len(f) == 0 {
		return "", errors.New("empty kernel_version")
	}
	return string(f[0]), nil
}

// bannerRelease scans r for "Linux version <release> (".
func bannerRelease(r io.ReaderAt) (string, error) {
	const banner = "Linux version "
	const chunk = 1 << 20
	buf := make([]byte, chunk+256)
	for off := int64(0); ; off += chunk {
		n, err := r.ReadAt(buf, off)
		b := buf[:n]
		for start := 0; ; {
			i := bytes.Index(b[start:], []byte(banner))
			if i < 0 {
				break
			}
			rest := b[start+i+len(banner):]
			// The format string "Linux version %s" also sits in the image;
			// the real banner has a release followed by " (".
			if end := bytes.IndexByte(rest, ' '); end > 0 && end+1 < len(rest) && rest[end+1] == '(' && rest[0] != '%' {
				return string(rest[:end]), nil
			}
			start += i + 1
		}
		if err != nil || n < len(buf) {
			return "", errors.New(`neither a bzImage nor an image holding a "Linux version" banner`)
		}
	}
}
