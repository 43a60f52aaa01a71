package appvm

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/follow"
	"vmhost/internal/redact"
)

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

// readLines returns the stored lines of the log at p (both generations).
func readLines(t *testing.T, p string) []logLine {
	t.Helper()
	var out []logLine
	for _, f := range []string{p + ".1", p} {
		b, err := os.ReadFile(f)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var ll logLine
			if err := json.Unmarshal(sc.Bytes(), &ll); err != nil {
				t.Fatalf("line %q: %v", sc.Text(), err)
			}
			out = append(out, ll)
		}
	}
	return out
}

// summary is "seq stream data" per line.
func summary(lines []logLine) string {
	var b strings.Builder
	for _, l := range lines {
		fmt.Fprintf(&b, "%d %s %q\n", l.Seq, l.Stream, l.Data)
	}
	return b.String()
}

func logMsg(stream string, seq uint64, data string) *proto.Log {
	return &proto.Log{Stream: stream, Seq: seq, Data: []byte(data), At: time.Date(2026, 1, 2, 3, 4, 5, int(seq), time.UTC)}
}

func openTestLog(t *testing.T, p string, max int64, secrets ...string) *workloadLog {
	t.Helper()
	l, err := openWorkloadLog(p, max, redact.New(secrets...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func appendAll(t *testing.T, l *workloadLog, msgs ...*proto.Log) {
	t.Helper()
	for _, m := range msgs {
		if err := l.Append(m, l.boot, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestWorkloadLogChunks: each guest chunk is a line, numbered, with its
// stream and the guest's time; a secret (env value, secret file content
// or one of its lines) is replaced even when chunks split it, and the
// chunks it spans share one line; bytes that are not UTF-8 become U+FFFD,
// but a character split between chunks is kept whole.
func TestWorkloadLogChunks(t *testing.T) {
	p := filepath.Join(t.TempDir(), logName)
	key := "-----BEGIN-----\nK3yL1neOfTheFile\n-----END-----\n"
	l := openTestLog(t, p, 1<<20, append([]string{"s3cr3t-value"}, redact.FileValues(key)...)...)
	if err := l.Begin("b1", false, nil); err != nil {
		t.Fatal(err)
	}
	appendAll(t, l,
		logMsg("stdout", 1, "hello\n"),
		logMsg("stderr", 2, "TOKEN=s3c"), // held: may begin the secret
		logMsg("stdout", 3, "key line: K3yL1neOfTheFile\n"),
		logMsg("stderr", 4, "r3t-value\n"),
		logMsg("stdout", 5, "caf\xc3"), // é cut in two
		logMsg("stdout", 6, "\xa9 \xff\n"),
	)
	want := `1 stdout "hello\n"
2 stdout "key line: [redacted]\n"
3 stderr "TOKEN=[redacted]\n"
4 stdout "café \uFFFD\n"
`
	want = strings.ReplaceAll(want, `\uFFFD`, "\uFFFD")
	lines := readLines(t, p)
	if got := summary(lines); got != want {
		t.Errorf("log:\n%s\nwant:\n%s", got, want)
	}
	if at := lines[2].Time; !at.Equal(time.Date(2026, 1, 2, 3, 4, 5, 2, time.UTC)) {
		t.Errorf("a line of two chunks has the time %v, want the first chunk's", at)
	}
	if lines[3].Boot != "b1" || lines[3].GuestOut != 6 || lines[3].GuestErr != 4 {
		t.Errorf("last line's guest numbers: %+v", lines[3])
	}
	raw, _ := os.ReadFile(p)
	for _, s := range []string{"s3cr3t", "K3yL1ne", "BEGIN"} {
		if bytes.Contains(raw, []byte(s)) {
			t.Errorf("the log holds %q", s)
		}
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o600 {
		t.Errorf("mode %v", st.Mode())
	}
}

// TestWorkloadLogAckHoldsBackHeldChunks: the acknowledgement stops below
// the oldest chunk held back, whatever its stream.
func TestWorkloadLogAckHoldsBackHeldChunks(t *testing.T) {
	l := openTestLog(t, filepath.Join(t.TempDir(), logName), 1<<20, "password123")
	l.Begin("b1", false, nil)
	appendAll(t, l, logMsg("stdout", 1, "a\n"), logMsg("stdout", 2, "pass"), logMsg("stderr", 3, "e\n"), logMsg("stderr", 4, "f\n"))
	if a, err := l.Ack(); err != nil || a != 1 {
		t.Errorf("Ack = %d, %v; want 1 (chunk 2 is held)", a, err)
	}
	appendAll(t, l, logMsg("stdout", 5, "port\n"))
	if a, _ := l.Ack(); a != 5 {
		t.Errorf("Ack = %d, want 5", a)
	}
	// Held at the workload's end: Flush stores it as it is.
	appendAll(t, l, logMsg("stdout", 6, "the end: pass"))
	if a, _ := l.Ack(); a != 5 {
		t.Errorf("Ack = %d, want 5", a)
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	if a, _ := l.Ack(); a != 6 {
		t.Errorf("Ack after Flush = %d, want 6", a)
	}
}

// TestWorkloadLogReplayAfterRestart: an agent killed with chunks stored,
// some not acknowledged and one held back: the next agent takes the
// numbering up, and the guest's replay stores each chunk exactly once.
func TestWorkloadLogReplayAfterRestart(t *testing.T) {
	p := filepath.Join(t.TempDir(), logName)
	l, err := openWorkloadLog(p, 1<<20, redact.New("password123"))
	if err != nil {
		t.Fatal(err)
	}
	l.Begin("b1", false, nil)
	msgs := []*proto.Log{
		logMsg("stdout", 1, "one\n"), logMsg("stderr", 2, "two\n"), logMsg("stdout", 3, "three pass"),
		logMsg("stderr", 4, "four\n"), logMsg("stdout", 5, "word123 five\n"), logMsg("stderr", 6, "six\n"),
	}
	appendAll(t, l, msgs[:4]...)
	acked, _ := l.Ack()
	l.f.Close() // SIGKILL: nothing flushed, nothing closed cleanly
	// A torn write at the end, too.
	f, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString(`{"seq":99,"time":"2026-`)
	f.Close()

	l = openTestLog(t, p, 1<<20, "password123")
	l.Begin("b1", true, nil)
	var replay []*proto.Log
	for _, m := range msgs {
		if m.Seq > acked {
			replay = append(replay, m)
		}
	}
	appendAll(t, l, replay...)
	want := `1 stdout "one\n"
2 stderr "two\n"
3 stderr "four\n"
4 stdout "three [redacted] five\n"
5 stderr "six\n"
`
	if got := summary(readLines(t, p)); got != want {
		t.Errorf("after the replay of %d.. :\n%s\nwant:\n%s", acked+1, got, want)
	}
	// A new boot numbers its chunks from 1 again; the log goes on. A late
	// chunk of the boot before is not taken for one of the new boot.
	l.Begin("b2", false, nil)
	if err := l.Append(logMsg("stdout", 7, "late\n"), "b1", time.Now()); err != nil {
		t.Fatal(err)
	}
	appendAll(t, l, logMsg("stdout", 1, "again\n"))
	lines := readLines(t, p)
	if last := lines[len(lines)-1]; last.Seq != 6 || last.Data != "again\n" || last.Boot != "b2" {
		t.Errorf("first line of the next boot: %+v", last)
	}
}

// TestWorkloadLogCap: the two generations together stay near the cap,
// the oldest chunks go first, and seq goes on across rotations.
func TestWorkloadLogCap(t *testing.T) {
	p := filepath.Join(t.TempDir(), logName)
	l := openTestLog(t, p, 4096)
	l.Begin("b", false, nil)
	for i := range 200 {
		appendAll(t, l, logMsg("stdout", uint64(i+1), fmt.Sprintf("line %03d\n", i)))
	}
	lines := readLines(t, p)
	if last := lines[len(lines)-1]; last.Seq != 200 || last.Data != "line 199\n" {
		t.Fatalf("last line %+v", last)
	}
	for i := 1; i < len(lines); i++ {
		if lines[i].Seq != lines[i-1].Seq+1 {
			t.Fatalf("seq %d after %d", lines[i].Seq, lines[i-1].Seq)
		}
	}
	var total int64
	for _, f := range []string{p, p + ".1"} {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		total += st.Size()
	}
	if total > 4096 || lines[0].Seq == 1 {
		t.Errorf("%d bytes kept from seq %d on, want at most 4096 and the oldest gone", total, lines[0].Seq)
	}
}

// TestMigrateLegacyLog: a raw workload.log (and .1) of the format before
// becomes the chunked log: a chunk per line, secrets the old writer did
// not replace (secret file contents) replaced, the old files gone.
func TestMigrateLegacyLog(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "workload.log.1"), []byte("old one\nold two with file-s3cret-"), 0o600)
	os.WriteFile(filepath.Join(dir, "workload.log"), []byte("content\nnew [redacted]\n"), 0o600)
	if err := migrateLegacyLog(dir, redact.New("file-s3cret-content")); err != nil {
		t.Fatal(err)
	}
	want := `1 stdout "old one\n"
2 stdout "old two with [redacted]\n"
3 stdout "new [redacted]\n"
`
	if got := summary(readLines(t, filepath.Join(dir, logName))); got != want {
		t.Errorf("migrated:\n%s\nwant:\n%s", got, want)
	}
	for _, f := range []string{"workload.log", "workload.log.1"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s still there: %v", f, err)
		}
	}
	// The writer goes on after the migrated lines.
	l := openTestLog(t, filepath.Join(dir, logName), 1<<20)
	l.Begin("b", false, nil)
	appendAll(t, l, logMsg("stdout", 1, "next\n"))
	if lines := readLines(t, filepath.Join(dir, logName)); lines[len(lines)-1].Seq != 4 {
		t.Errorf("after migration: %s", summary(lines))
	}
	if err := migrateLegacyLog(dir, nil); err != nil {
		t.Errorf("nothing left to migrate: %v", err)
	}
}

// writeTestLog writes n chunks alternating stdout and stderr through the
// writer, rotating (small cap).
func writeTestLog(t *testing.T, p string, n int, max int64) {
	t.Helper()
	l := openTestLog(t, p, max)
	l.Begin("b", false, nil)
	for i := 1; i <= n; i++ {
		stream := "stdout"
		if i%2 == 0 {
			stream = "stderr"
		}
		appendAll(t, l, logMsg(stream, uint64(i), fmt.Sprintf("chunk %d\n", i)))
	}
}

func openPair(t *testing.T, p string) *follow.Reader {
	t.Helper()
	w := follow.NewWatcher()
	t.Cleanup(func() { w.Close() })
	r, err := w.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// readFrom returns the seqs of the lines from pos on (the stream's only).
func readFrom(t *testing.T, r *follow.Reader, pos int64, stream string) []uint64 {
	t.Helper()
	r.SetPos(pos)
	lr := &lineReader{r: r}
	var out []uint64
	for {
		line, err := lr.next()
		if err != nil {
			return out
		}
		ll, ok := decodeLine(line)
		if !ok {
			t.Fatalf("line %q", line)
		}
		if stream == "" || ll.Stream == stream {
			out = append(out, ll.Seq)
		}
	}
}

func TestTailAndSincePositions(t *testing.T) {
	p := filepath.Join(t.TempDir(), logName)
	writeTestLog(t, p, 300, 8192) // rotated: both generations hold lines
	r := openPair(t, p)
	all := readFrom(t, r, 0, "")
	first, last := all[0], all[len(all)-1]
	if last != 300 || first == 1 {
		t.Fatalf("kept %d..%d", first, last)
	}
	for _, tc := range []struct {
		n      int
		stream string
		want   []uint64
	}{
		{3, "", []uint64{298, 299, 300}},
		{2, "stdout", []uint64{297, 299}},
		{2, "stderr", []uint64{298, 300}},
		{0, "", nil},
	} {
		pos, err := tailPos(r, tc.n, tc.stream)
		if err != nil {
			t.Fatal(err)
		}
		if got := readFrom(t, r, pos, tc.stream); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("tail %d %s = %v, want %v", tc.n, tc.stream, got, tc.want)
		}
	}
	if pos, _ := tailPos(r, 100000, ""); pos != 0 {
		t.Errorf("a tail longer than the log starts at %d", pos)
	}
	for _, since := range []uint64{0, first - 1, first, first + 7, 150, 299, 300, 1000} {
		pos, err := sincePos(r, since)
		if err != nil {
			t.Fatal(err)
		}
		got := readFrom(t, r, pos, "")
		want := uint64(max(since+1, first))
		if since >= 300 {
			if len(got) != 0 {
				t.Errorf("since %d: %v", since, got)
			}
			continue
		}
		if len(got) == 0 || got[0] != want || got[len(got)-1] != 300 {
			t.Errorf("since %d: from %v, want from %d", since, got[:min(3, len(got))], want)
		}
	}
}
