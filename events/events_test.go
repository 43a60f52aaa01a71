package events

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func open(t *testing.T, dir string, keep int) *Log {
	t.Helper()
	l, err := Open(dir, Options{Keep: keep})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// waitDurable waits until the flusher made seq visible.
func waitDurable(t *testing.T, l *Log, seq uint64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for l.Last() < seq {
		if time.Now().After(deadline) {
			t.Fatalf("seq %d never became durable (last %d)", seq, l.Last())
		}
		_, _, changed := l.After(l.Last(), 0)
		select {
		case <-changed:
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func decode(t *testing.T, entries []Entry) []Event {
	t.Helper()
	var out []Event
	for _, e := range entries {
		var ev Event
		if err := json.Unmarshal(e.JSON, &ev); err != nil {
			t.Fatal(err)
		}
		if ev.Seq != e.Seq || ev.VMID != e.VMID {
			t.Fatalf("entry %d/%q holds event %d/%q", e.Seq, e.VMID, ev.Seq, ev.VMID)
		}
		out = append(out, ev)
	}
	return out
}

// TestSeqContinuesAcrossReopen: seq grows by one per event, every event is
// read back after a reopen with its fields, and the next event continues
// the sequence.
func TestSeqContinuesAcrossReopen(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, 100)
	for i := range 10 {
		l.Publish(Event{Type: StateChanged, VMID: "vm-" + string(rune('a'+i)), State: "running"})
	}
	waitDurable(t, l, 10)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l = open(t, dir, 100)
	entries, reset, _ := l.After(0, 100)
	if reset || len(entries) != 10 {
		t.Fatalf("after reopen: %d entries, reset %v; want 10, false", len(entries), reset)
	}
	for i, ev := range decode(t, entries) {
		if ev.Seq != uint64(i+1) || ev.Type != StateChanged || ev.State != "running" || ev.Time.IsZero() {
			t.Fatalf("event %d = %+v", i, ev)
		}
	}
	l.Publish(Event{Type: Deleted, VMID: "vm-z"})
	waitDurable(t, l, 11)
	entries, _, _ = l.After(10, 100)
	if evs := decode(t, entries); len(evs) != 1 || evs[0].Seq != 11 || evs[0].Type != Deleted {
		t.Fatalf("after 10: %+v", evs)
	}
}

// TestTornLineCut: a last line cut short by a crash is dropped at open, and
// the next event is appended on a line of its own.
func TestTornLineCut(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, 100)
	l.Publish(Event{Type: Created, VMID: "a"})
	l.Publish(Event{Type: Created, VMID: "b"})
	waitDurable(t, l, 2)
	l.Close()
	path := filepath.Join(dir, currentName)
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"seq":3,"time":"2026-`)
	f.Close()

	l = open(t, dir, 100)
	l.Publish(Event{Type: Deleted, VMID: "a"})
	waitDurable(t, l, 3)
	l.Close()
	l = open(t, dir, 100)
	entries, _, _ := l.After(0, 100)
	evs := decode(t, entries)
	if len(evs) != 3 || evs[2].Seq != 3 || evs[2].Type != Deleted {
		t.Fatalf("events after a torn line: %+v", evs)
	}
}

// TestRotationKeepsAtLeastKeep: with Keep 5, 23 events leave between 5 and
// 10 kept, in two files, the newest included; a resume point older than
// what is kept asks for a reset, one inside it does not.
func TestRotationKeepsAtLeastKeep(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, 5)
	for range 23 {
		l.Publish(Event{Type: HealthChanged, VMID: "x", Health: "healthy"})
	}
	waitDurable(t, l, 23)
	check := func(l *Log) {
		t.Helper()
		entries, reset, _ := l.After(0, 100)
		if !reset || entries != nil {
			t.Fatalf("resume from 0 with events 1..10 gone: reset %v, %d entries", reset, len(entries))
		}
		first := 23 - 5
		entries, reset, _ = l.After(uint64(first), 100)
		if reset || len(entries) != 5 || entries[4].Seq != 23 {
			t.Fatalf("resume from %d: reset %v, %d entries", first, reset, len(entries))
		}
		if _, reset, _ := l.After(30, 100); !reset {
			t.Fatal("a resume point beyond the newest event (a removed log) does not ask for a reset")
		}
	}
	check(l)
	l.Close()
	for _, name := range []string{currentName, previousName} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", name, fi.Mode().Perm())
		}
	}
	l = open(t, dir, 5)
	check(l)
	all, reset, _ := l.After(l.kept[0].Seq-1, 100)
	if reset || len(all) < 5 || len(all) > 10 || all[len(all)-1].Seq != 23 {
		t.Fatalf("kept after reopen: %d events (reset %v), want 5..10 ending at 23", len(all), reset)
	}
}

// TestChangedWakesReader: a reader waiting on changed is woken once a new
// event is synced and can read it.
func TestChangedWakesReader(t *testing.T) {
	l := open(t, t.TempDir(), 100)
	_, _, changed := l.After(0, 10)
	l.Publish(Event{Type: Created, VMID: "a"})
	select {
	case <-changed:
	case <-time.After(5 * time.Second):
		t.Fatal("a reader was not woken by a new event")
	}
	if entries, _, _ := l.After(0, 10); len(entries) != 1 {
		t.Fatalf("after the wake-up: %d entries, want 1", len(entries))
	}
}
