package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/jail"
	"vmhost/vm/record"
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

// TestSavedInitramfs: a restore's jail gets the initramfs the saved
// configuration names only when it is a file of the run directory that
// every user may read: the saved state is the VM's to write.
func TestSavedInitramfs(t *testing.T) {
	base := t.TempDir()
	l := record.Layout{StateDir: filepath.Join(base, "state"), RunDir: filepath.Join(base, "run")}
	dir := filepath.Join(base, "suspend")
	for _, d := range []string{l.RunDir, dir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	good := filepath.Join(l.RunDir, "appvm-initramfs-ab.cpio")
	private := filepath.Join(l.RunDir, "keys.json")
	outside := filepath.Join(base, "elsewhere.cpio")
	link := filepath.Join(l.RunDir, "link.cpio")
	for f, mode := range map[string]os.FileMode{good: 0o644, private: 0o600, outside: 0o644} {
		if err := os.WriteFile(f, []byte("x"), mode); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ names, want string }{
		{good, good},
		{private, ""},
		{outside, ""},
		{link, ""},
		{l.RunDir + "/vms/../appvm-initramfs-ab.cpio", ""},
		{"", ""},
	} {
		cfg := `{"payload":{"kernel":"/k","initramfs":"` + c.names + `"}}`
		if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
		if got := savedInitramfs(l, dir); got != c.want {
			t.Errorf("saved initramfs %q: got %q, want %q", c.names, got, c.want)
		}
	}
	os.Remove(filepath.Join(dir, "config.json"))
	if got := savedInitramfs(l, dir); got != "" {
		t.Errorf("no saved configuration: got %q", got)
	}
	// A FIFO in its place is not waited on.
	if err := syscall.Mkfifo(filepath.Join(dir, "config.json"), 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 1)
	go func() { done <- savedInitramfs(l, dir) }()
	select {
	case got := <-done:
		if got != "" {
			t.Errorf("saved configuration a FIFO: got %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("savedInitramfs blocked on a FIFO")
	}
}

// TestJailIDsNeverGivenTwice: creates claiming their jail under the
// records' lock (Claim) and VMs of an unconfined past getting theirs at
// boot (recordJail) at the same time never get one id, and an id range
// exactly as large as the VMs is used whole.
func TestJailIDsNeverGivenTwice(t *testing.T) {
	const n = 24 // old VMs, and as many creates
	s := newJailingService(t, [2]uint32{1700000, 1700000 + 2*n - 1})
	for i := range n {
		if err := s.recs.Create(newRecord(&record.Spec{VMID: fmt.Sprintf("old%d", i)})); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2*n)
	for i := range n {
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, err := s.recordJail(s.recs.Get(fmt.Sprintf("old%d", i)))
			errs <- err
		}()
		go func() {
			defer wg.Done()
			rec := newRecord(&record.Spec{VMID: fmt.Sprintf("new%d", i)})
			err := s.recs.Reserve(rec, func(others []*record.Record) error { return s.Claim(rec, others) })
			if err == nil {
				err = s.recs.Create(rec)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	seen := map[uint32]string{}
	for _, r := range s.recs.All() {
		if r.Jail == nil {
			t.Fatalf("%s has no jail", r.ID)
		}
		if other, dup := seen[r.Jail.UID]; dup {
			t.Errorf("%s and %s both got uid %d", other, r.ID, r.Jail.UID)
		}
		seen[r.Jail.UID] = r.ID
	}
	// Every id is held: one more create is refused by its claim.
	rec := newRecord(&record.Spec{VMID: "over"})
	if err := s.recs.Reserve(rec, func(others []*record.Record) error { return s.Claim(rec, others) }); !errors.Is(err, jail.ErrNoFreeID) {
		t.Errorf("a claim with every id held = %v, want ErrNoFreeID", err)
	}
}

// newJailingService is a test service whose engine confines VMs with ids
// from idRange: its jailer gives ids and paths, and makes no cgroup (its
// layout names none that exist). It is on only as root.
func newJailingService(t *testing.T, idRange [2]uint32) *testService {
	if os.Geteuid() != 0 {
		t.Skip("a jailer is on only as root")
	}
	return newTestServiceWith(t, testOpts{edit: func(o *Options) {
		cfg := o.Config.Jail
		cfg.Enabled = new(true)
		cfg.IDRange = idRange
		j, err := jail.New(cfg, jail.Host{RunDir: o.RunDir, AgentID: "a1",
			Layout: &jail.Layout{V1: map[string]string{"memory": "/x", "pids": "/x", "cpu": "/x", "cpuacct": "/x"}}})
		if err != nil {
			t.Fatal(err)
		}
		o.Jail = j
	}})
}

// TestFailedHotAttachTakesTheVolumeBack: an attach of a first-class volume
// that fails (here at once: the VM's storage daemon is not held, as after
// an agent restart that did not adopt it) takes the volume out of the
// VM's record, so the link a run cut short left in the VM's directory goes
// and the volume is root's again.
func TestFailedHotAttachTakesTheVolumeBack(t *testing.T) {
	s := newJailingService(t, [2]uint32{1700100, 1700199})
	const uid = 1700123
	rec := newRecord(&record.Spec{VMID: "vo", Volumes: []record.VolumeSpec{{ID: "fcv", VolumeID: "fcv"}}})
	rec.State = record.StateRunning
	rec.Jail = &record.Confinement{UID: uid, GID: uid, Cgroup: "vmhost/a1/vm-vo"}
	if err := s.recs.Create(rec); err != nil {
		t.Fatal(err)
	}
	l := s.layout()
	vol, link := l.Volume("fcv"), s.volumeLink("vo", "fcv")
	for _, d := range []string{filepath.Dir(vol), filepath.Dir(link)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(vol, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(vol, uid, uid); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(vol, link); err != nil {
		t.Fatal(err)
	}
	if err := s.HotAttach(t.Context(), rec, "fcv"); err == nil {
		t.Fatal("HotAttach without a storage daemon succeeded")
	}
	if _, err := os.Lstat(link); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the volume's link is still in the VM's directory (%v)", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(vol, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("the volume is %d:%d's, want root's", st.Uid, st.Gid)
	}
}
