package guest

import (
	"os"
	"path/filepath"
	"testing"

	"vmhost/appvm/guest/proto"
)

func TestParseCmdline(t *testing.T) {
	s := newVMSystem(nil)
	s.parseCmdline("console=hvc0 root=/dev/vda vmhost.root=/dev/vdb vmhost.rootfstype=xfs vmhost.port=2048 quiet\n")
	if s.rootDev != "/dev/vdb" || s.rootFSType != "xfs" || s.port != 2048 {
		t.Errorf("parsed %q %q %d", s.rootDev, s.rootFSType, s.port)
	}
	d := newVMSystem(nil)
	d.parseCmdline("console=hvc0 vmhost.port=notanumber")
	if d.rootDev != "/dev/vda" || d.rootFSType != "ext4" || d.port != proto.Port {
		t.Errorf("defaults: %q %q %d", d.rootDev, d.rootFSType, d.port)
	}
}

func TestTmpfsOptions(t *testing.T) {
	tests := []struct {
		in   proto.TmpfsMount
		want string
	}{
		{proto.TmpfsMount{Path: "/t"}, "mode=1777"},
		{proto.TmpfsMount{Path: "/t", SizeBytes: 4096, Mode: 0o750}, "mode=750,size=4096"},
	}
	for _, tt := range tests {
		if got := tmpfsOptions(tt.in); got != tt.want {
			t.Errorf("tmpfsOptions(%+v) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestInRoot(t *testing.T) {
	root := t.TempDir()
	mustSymlink(t, "/etc/real", root+"/etc/abs")
	mustSymlink(t, "../../../..", root+"/etc/up")
	mustSymlink(t, "loop2", root+"/loop1")
	mustSymlink(t, "loop1", root+"/loop2")
	tests := []struct {
		in, want string
	}{
		{"/etc/abs/x", root + "/etc/real/x"},
		{"/etc/up/etc/passwd", root + "/etc/passwd"},
		{"/../../x", root + "/x"},
		{"/a/./b/../c", root + "/a/c"},
	}
	for _, tt := range tests {
		got, err := inRoot(root, tt.in)
		if err != nil || got != tt.want {
			t.Errorf("inRoot(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
	if _, err := inRoot(root, "/loop1/x"); err == nil {
		t.Error("inRoot followed a symlink loop without error")
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}
