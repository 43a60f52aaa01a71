package engine

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A payload a confined CH opens must be readable by the VM's uid: by its
// owner's, group's or everyone's bits, whichever apply to that uid.
func TestReadableBy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give files to other owners")
	}
	dir := t.TempDir()
	const uid, gid = 1000123, 1000123
	for _, c := range []struct {
		mode     os.FileMode
		uid, gid int
		ok       bool
	}{
		{0o644, 0, 0, true},
		{0o600, 0, 0, false}, // Debian's /boot/vmlinuz-*
		{0o640, 0, gid, true},
		{0o604, 0, gid, false}, // the group's bits apply, not everyone's
		{0o400, uid, 0, true},
		{0o044, uid, 0, false}, // the owner's bits apply
	} {
		p := filepath.Join(dir, "kernel")
		os.Remove(p)
		if err := os.WriteFile(p, nil, c.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, c.mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, c.uid, c.gid); err != nil {
			t.Fatal(err)
		}
		err := readableBy(p, uid, gid)
		if (err == nil) != c.ok {
			t.Errorf("mode %04o owner %d:%d: %v, want readable %t", c.mode, c.uid, c.gid, err, c.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "chmod a+r "+p) {
			t.Errorf("error %q does not say how to fix it", err)
		}
	}
}
