package disk

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"vmhost/qcow2"
)

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// qcow2Bytes returns a blank qcow2 image of size bytes.
func qcow2Bytes(t testing.TB, size uint64) []byte {
	t.Helper()
	p := filepath.Join(t.TempDir(), "img.qcow2")
	if err := qcow2.Create(p, size); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// dirEntries lists a cache directory, temp files included.
func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func TestFetch(t *testing.T) {
	img := qcow2Bytes(t, 1<<30)
	img = append(img, make([]byte, 3<<20)...) // a body long enough for progress to matter
	overlay := func() []byte {
		dir := t.TempDir()
		base := filepath.Join(dir, "base.qcow2")
		ov := filepath.Join(dir, "ov.qcow2")
		if err := qcow2.Create(base, 1<<30); err != nil {
			t.Fatal(err)
		}
		needTool(t, "qemu-img")
		run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", ov)
		b, _ := os.ReadFile(ov)
		return b
	}()
	notQcow2 := make([]byte, 1<<20)
	rand.Read(notQcow2)

	mux := http.NewServeMux()
	serve := func(path string, body []byte) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			w.Write(body)
		})
	}
	serve("/img.qcow2", img)
	serve("/overlay.qcow2", overlay)
	serve("/random.bin", notQcow2)
	mux.HandleFunc("/truncated.qcow2", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		w.Write(img[:len(img)/2])
		// Returning with bytes owed makes the server close the connection.
	})
	mux.HandleFunc("/loop", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/loop", http.StatusFound)
	})
	mux.HandleFunc("/hop", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/img.qcow2", http.StatusMovedPermanently)
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for _, tc := range []struct {
		name, path, sha, want string
		maxBytes              int64
		is                    func(error) bool
	}{
		{name: "success", path: "/img.qcow2", sha: digest(img)},
		{name: "redirect followed", path: "/hop", sha: digest(img)},
		{name: "digest mismatch", path: "/img.qcow2", sha: digest(notQcow2), want: "content sha256 mismatch: expected " + digest(notQcow2) + ", got " + digest(img),
			is: func(err error) bool { return errors.Is(err, ErrDigestMismatch) }},
		{name: "404", path: "/missing.qcow2", sha: digest(img), want: "HTTP status 404 Not Found",
			is: func(err error) bool { var h *HTTPStatusError; return errors.As(err, &h) && h.StatusCode == 404 }},
		{name: "truncated body", path: "/truncated.qcow2", sha: digest(img), want: "truncated body"},
		{name: "not qcow2", path: "/random.bin", sha: digest(notQcow2), want: "not a qcow2 image",
			is: func(err error) bool { return errors.Is(err, qcow2.ErrNotQcow2) }},
		{name: "backing file", path: "/overlay.qcow2", sha: digest(overlay), want: "backing file"},
		{name: "redirect loop", path: "/loop", sha: digest(img), want: "stopped after 5 redirects"},
		{name: "size cap", path: "/img.qcow2", sha: digest(img), maxBytes: 1 << 20, want: "exceeds the size cap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c, err := NewCache(dir, CacheOptions{MaxBytes: tc.maxBytes})
			if err != nil {
				t.Fatal(err)
			}
			var last [2]int64
			var calls int
			path, err := c.Fetch(context.Background(), srv.URL+tc.path, tc.sha, func(done, total int64) {
				calls++
				last = [2]int64{done, total}
			})
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Fetch = %q, %v; want an error containing %q", path, err, tc.want)
				}
				if tc.is != nil && !tc.is(err) {
					t.Errorf("error %v does not match its type", err)
				}
				if names := dirEntries(t, dir); len(names) != 0 {
					t.Errorf("files left after a failed fetch: %v", names)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if path != filepath.Join(dir, "sha256-"+tc.sha+".qcow2") {
				t.Errorf("path = %s", path)
			}
			got, err := os.ReadFile(path)
			if err != nil || digest(got) != tc.sha {
				t.Errorf("cached file has digest %s (%v), want %s", digest(got), err, tc.sha)
			}
			if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
				t.Errorf("cached file mode = %v, want 0600", st.Mode().Perm())
			}
			if calls == 0 || last != [2]int64{int64(len(img)), int64(len(img))} {
				t.Errorf("progress: %d calls, last %v; want a final report of %d/%d", calls, last, len(img), len(img))
			}
			if names := dirEntries(t, dir); len(names) != 1 {
				t.Errorf("cache dir holds %v, want just the image", names)
			}
			// A second fetch is answered from the cache without a request.
			if p2, err := c.Fetch(context.Background(), "http://127.0.0.1:1/unreachable", tc.sha, nil); err != nil || p2 != path {
				t.Errorf("cached Fetch = %s, %v", p2, err)
			}
		})
	}

	c, err := NewCache(t.TempDir(), CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []struct{ url, sha string }{
		{"ftp://example.com/x.qcow2", digest(img)},
		{"not a url", digest(img)},
		{srv.URL + "/img.qcow2", "abc"},
	} {
		if _, err := c.Fetch(context.Background(), bad.url, bad.sha, nil); err == nil {
			t.Errorf("Fetch(%q, %q) succeeded", bad.url, bad.sha)
		}
	}
}

// TestFetchShared: two concurrent creates of one digest make one request;
// a caller that gives up does not cancel the download for the other.
func TestFetchShared(t *testing.T) {
	img := qcow2Bytes(t, 10<<30)
	var requests atomic.Int32
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		w.Write(img[:100])
		w.(http.Flusher).Flush()
		<-release
		w.Write(img[100:])
	}))
	defer srv.Close()
	dir := t.TempDir()
	c, err := NewCache(dir, CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sha := digest(img)
	var wg sync.WaitGroup
	paths := make([]string, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = c.Fetch(context.Background(), srv.URL+"/img", sha, nil)
		}()
	}
	// A third caller that gives up early.
	ctx, cancel := context.WithCancel(context.Background())
	quitter := make(chan error, 1)
	go func() {
		_, err := c.Fetch(ctx, srv.URL+"/img", sha, nil)
		quitter <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for requests.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // let all three join
	cancel()
	if err := <-quitter; !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled caller got %v", err)
	}
	close(release)
	wg.Wait()
	for i := range 2 {
		if errs[i] != nil || paths[i] != c.Path(sha) {
			t.Errorf("caller %d: %s, %v", i, paths[i], errs[i])
		}
	}
	if n := requests.Load(); n != 1 {
		t.Errorf("%d requests for one digest, want 1", n)
	}
}

// TestFetchCancelled: when the only caller gives up, the download stops
// and leaves nothing behind.
func TestFetchCancelled(t *testing.T) {
	img := qcow2Bytes(t, 1<<30)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		w.Write(img[:100])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	dir := t.TempDir()
	c, err := NewCache(dir, CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := c.Fetch(ctx, srv.URL, digest(img), nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Fetch = %v, want DeadlineExceeded", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(dirEntries(t, dir)) != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if names := dirEntries(t, dir); len(names) != 0 {
		t.Errorf("files left after cancel: %v", names)
	}
}

// BenchmarkDownload fetches a 1 GiB image over loopback and, side by side,
// runs sha256sum on the same file: Fetch hashes while it streams, so its
// throughput should stay close to (target ≥ 80% of) sha256sum's.
func BenchmarkDownload(b *testing.B) {
	dir := b.TempDir()
	src := filepath.Join(dir, "src.qcow2")
	const size = 1 << 30
	if err := qcow2.Create(src, size); err != nil {
		b.Fatal(err)
	}
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		b.Fatal(err)
	}
	h := sha256.New()
	hdr, _ := os.ReadFile(src)
	h.Write(hdr)
	chunk := make([]byte, 4<<20)
	for off := int64(len(hdr)); off < size; off += int64(len(chunk)) {
		rand.Read(chunk)
		n := min(int64(len(chunk)), size-off)
		f.WriteAt(chunk[:n], off)
		h.Write(chunk[:n])
	}
	f.Close()
	sha := hex.EncodeToString(h.Sum(nil))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeFile(w, r, src)
	}))
	defer srv.Close()

	b.Run("disk.Cache.Fetch", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			b.StopTimer()
			cdir := filepath.Join(dir, "cache")
			os.RemoveAll(cdir)
			c, err := NewCache(cdir, CacheOptions{})
			if err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			if _, err := c.Fetch(context.Background(), srv.URL+"/src.qcow2", sha, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	if p, err := exec.LookPath("sha256sum"); err == nil {
		b.Run("sha256sum", func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				out, err := exec.Command(p, src).Output()
				if err != nil || !strings.HasPrefix(string(out), sha) {
					b.Fatalf("sha256sum: %q, %v", out, err)
				}
			}
		})
	}
}

// TestFetchErrorsHideCredentials: a fetch_url's user info and query (basic
// auth, a presigned URL's token) never reach an error, which the engine
// puts in failure_reason.summary and the log.
func TestFetchErrorsHideCredentials(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close() // connection refused: net/http's own *url.Error path
	sha := digest([]byte("x"))
	for _, base := range []string{srv.URL, closed.URL} {
		u := strings.Replace(base, "http://", "http://alice:pw-secret@", 1) + "/img.qcow2?X-Amz-Signature=sig-secret#frag-secret"
		c, err := NewCache(t.TempDir(), CacheOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Fetch(context.Background(), u, sha, nil)
		if err == nil {
			t.Fatalf("Fetch(%s) succeeded", base)
		}
		msg := err.Error()
		for _, secret := range []string{"alice", "pw-secret", "sig-secret", "frag-secret"} {
			if strings.Contains(msg, secret) {
				t.Errorf("error %q shows %q", msg, secret)
			}
		}
		if !strings.Contains(msg, strings.TrimPrefix(base, "http://")+"/img.qcow2?REDACTED") {
			t.Errorf("error %q does not name the host and path", msg)
		}
	}
}

// TestNewCacheRemovesTemps: temp files of downloads cut short by a crash,
// in atomicfile's naming and in the .download- naming of older versions,
// go when the cache opens; images stay.
func TestNewCacheRemovesTemps(t *testing.T) {
	dir := t.TempDir()
	image := "sha256-" + strings.Repeat("a", 64) + ".qcow2"
	for _, name := range []string{image, "." + image + ".tmp-0123", ".download-sha256-" + strings.Repeat("b", 64) + "-1"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := NewCache(dir, CacheOptions{}); err != nil {
		t.Fatal(err)
	}
	if names := dirEntries(t, dir); len(names) != 1 || names[0] != image {
		t.Errorf("cache directory = %v, want only %s", names, image)
	}
}

// TestFetchRefusesNonRegularTarget: a dangling symlink where the image
// belongs is not replaced (it was, before downloads went through
// atomicfile), and no temp file is left.
func TestFetchRefusesNonRegularTarget(t *testing.T) {
	img := qcow2Bytes(t, 1<<20)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(img) }))
	defer srv.Close()
	dir := t.TempDir()
	c, err := NewCache(dir, CacheOptions{})
	if err != nil {
		t.Fatal(err)
	}
	elsewhere := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Symlink(elsewhere, c.Path(digest(img))); err != nil {
		t.Fatal(err)
	}
	_, err = c.Fetch(context.Background(), srv.URL, digest(img), nil)
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Fetch over a symlink = %v, want a not-a-regular-file error", err)
	}
	if fi, err := os.Lstat(c.Path(digest(img))); err != nil || fi.Mode().Type() != fs.ModeSymlink {
		t.Errorf("symlink replaced: %v, %v", fi, err)
	}
	if _, err := os.Lstat(elsewhere); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("symlink target written: %v", err)
	}
	if names := dirEntries(t, dir); len(names) != 1 {
		t.Errorf("cache directory = %v, want only the symlink", names)
	}
}
