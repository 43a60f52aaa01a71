package fatcheck_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/seed/fat"
	"vmhost/seed/internal/fatcheck"
)

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	errors []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
}

// TestFsckFlagsWarningsWithExitZero proves the output check is what catches
// a broken long name: fsck.fat exits 0 for a wrong LFN checksum.
func TestFsckFlagsWarningsWithExitZero(t *testing.T) {
	fatcheck.Need(t, "fsck.fat")
	img, err := fat.Build([]fat.File{{Name: "meta-data", Data: []byte("x")}}, fat.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	good := filepath.Join(dir, "good.img")
	bad := filepath.Join(dir, "bad.img")
	if err := os.WriteFile(good, img, 0o644); err != nil {
		t.Fatal(err)
	}
	img[0xA20+13] ^= 0xFF // LFN checksum of meta-data
	if err := os.WriteFile(bad, img, 0o644); err != nil {
		t.Fatal(err)
	}

	r := &recorder{TB: t}
	fatcheck.Fsck(r, good)
	if len(r.errors) != 0 {
		t.Fatalf("good image flagged: %q", r.errors)
	}
	fatcheck.Fsck(r, bad)
	if len(r.errors) == 0 || !strings.Contains(strings.Join(r.errors, "\n"), "checksum") {
		t.Errorf("bad image: failures %q, want one naming the checksum", r.errors)
	}
}
