package appvm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWorkloadLogRotatesAndScrubs(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "workload.log")
	l, err := openWorkloadLog(p, 100, []string{"hunter22", "ab"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.Write([]byte("pw=hunter22 ab\n")); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	// Values shorter than minScrubbed stay (they would mangle output).
	if string(b) != "pw=[redacted] ab\n" {
		t.Errorf("log = %q", b)
	}
	for range 10 {
		if _, err := l.Write([]byte(strings.Repeat("x", 39) + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	cur, _ := os.Stat(p)
	old, err := os.Stat(p + ".1")
	if err != nil {
		t.Fatalf("no rotated file: %v", err)
	}
	if cur.Size() > 100 || old.Size() > 100 {
		t.Errorf("sizes %d and %d, want each at most 100", cur.Size(), old.Size())
	}
	if cur.Mode().Perm() != 0o600 || old.Mode().Perm() != 0o600 {
		t.Errorf("modes %v %v, want 0600", cur.Mode(), old.Mode())
	}
	if _, err := os.Stat(p + ".2"); err == nil {
		t.Error("a second rotated file exists; want one")
	}
}

func TestBackoff(t *testing.T) {
	o := RestartOptions{BaseDelay: 100e6, MaxDelay: 1e9}
	var got []string
	for c := range uint32(7) {
		got = append(got, o.Backoff(c).String())
	}
	if want := "100ms 200ms 400ms 800ms 1s 1s 1s"; strings.Join(got, " ") != want {
		t.Errorf("backoff = %v, want %s", got, want)
	}
	if d := o.Backoff(1 << 30); d != 1e9 {
		t.Errorf("huge count backoff = %v", d)
	}
}

func TestWorkloadLogScrubsSecretSplitAcrossWrites(t *testing.T) {
	p := filepath.Join(t.TempDir(), "workload.log")
	l, err := openWorkloadLog(p, 1<<20, []string{"s3cr3t-value"})
	if err != nil {
		t.Fatal(err)
	}
	for _, chunk := range []string{"TOKEN=s3c", "r3t-", "value\nnext s3", "cr3t-value\nend s3cr"} {
		if _, err := l.Write([]byte(chunk)); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	// The held tail "s3cr" never became the value: Flush writes it as is.
	if want := "TOKEN=[redacted]\nnext [redacted]\nend s3cr"; string(b) != want {
		t.Errorf("log = %q, want %q", b, want)
	}
	if _, err := l.Write([]byte("r3t-value")); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(p)
	// Flushed output is not held again: the next chunk stands alone.
	if want := "TOKEN=[redacted]\nnext [redacted]\nend s3crr3t-value"; string(b) != want {
		t.Errorf("log after close = %q, want %q", b, want)
	}
}
