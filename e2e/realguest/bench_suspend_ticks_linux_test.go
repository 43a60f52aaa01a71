package realguest

import (
	"os"
	"path/filepath"
	"testing"
)

// TestSuspendBenchTicks: the suspend benchmark's reading of the guest's
// ticks (no guest needed). A tick line the suspend cut in two counts once,
// whole, when its end comes after the offset; a line that ended before it
// does not count; the console log is followed across its rotation.
func TestSuspendBenchTicks(t *testing.T) {
	out := "benchguest: booted\r\nbenchguest: tick 1\r\nbenchguest: tick 2\r\nbenchguest: ti"
	if got := lastTickIn(out); got != 2 {
		t.Errorf("lastTickIn = %d, want 2 (the cut line is not whole yet)", got)
	}
	off := len(out)
	out += "ck 3\r\nbenchguest: tick 4\r\n"
	if got := firstTickAfter(out, off, 2); got != 3 {
		t.Errorf("firstTickAfter the cut = %d, want 3", got)
	}
	if got := firstTickAfter(out, len(out)-5, 0); got != 4 {
		t.Errorf("firstTickAfter inside tick 4's line = %d, want 4", got)
	}
	if got := firstTickAfter(out, len(out), 0); got != 0 {
		t.Errorf("firstTickAfter the end = %d, want 0", got)
	}

	dir := t.TempDir()
	path := filepath.Join(dir, "console.log")
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(path, "benchguest: tick 7\r\nbenchguest: ti")
	c := &consoleLog{path: path}
	end, last := c.settle(t)
	if end != 34 || last != 7 {
		t.Fatalf("settle = %d, %d, want 34, 7", end, last)
	}
	// The log is rotated, as the agent does: its file, with the end of the
	// line and one more, becomes the older generation, a new file the next.
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("ck 8\r\n")
	f.Close()
	if err := os.Rename(path, path+".1"); err != nil {
		t.Fatal(err)
	}
	write(path, "benchguest: tick 9\r\n")
	text, start, newEnd := c.read(t, end)
	if text != "ck 8\r\nbenchguest: tick 9\r\n" || start != end || newEnd != 60 {
		t.Errorf("read after the rotation = %q from %d to %d", text, start, newEnd)
	}
	if got := c.waitTick(t, end, last, 0); got != 8 {
		t.Errorf("waitTick across the rotation = %d, want 8", got)
	}
}
