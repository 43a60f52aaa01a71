package disk

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

// cacheServer serves images by digest at /<digest>.
func cacheServer(t *testing.T, images map[string][]byte) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, ok := images[strings.TrimPrefix(r.URL.Path, "/")]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Write(b)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// sizedImages returns n distinct valid images, image i padded to
// (i+1) MiB.
func sizedImages(t *testing.T, n int) (map[string][]byte, []string) {
	base := qcow2Bytes(t, 1<<30)
	images := map[string][]byte{}
	var digests []string
	for i := range n {
		b := append(append([]byte{}, base...), make([]byte, (i+1)<<20-len(base))...)
		b[len(b)-1] = byte(i + 1)
		d := digest(b)
		images[d] = b
		digests = append(digests, d)
	}
	return images, digests
}

func TestCacheListDeleteAndPins(t *testing.T) {
	images, ds := sizedImages(t, 2)
	srv := cacheServer(t, images)
	c, err := NewCache(t.TempDir(), CacheOptions{Client: srv.Client()})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, d := range ds {
		if _, err := c.Fetch(ctx, srv.URL+"/"+d, d, nil); err != nil {
			t.Fatal(err)
		}
	}
	// Using ds[0] again makes it the most recently used; its cached_at
	// stays when it was downloaded.
	before, _ := c.Stat(ds[0])
	time.Sleep(20 * time.Millisecond)
	release := c.Use(ds[0])
	if _, err := c.Fetch(ctx, srv.URL+"/"+ds[0], ds[0], nil); err != nil {
		t.Fatal(err)
	}
	list, err := c.List()
	if err != nil || len(list) != 2 {
		t.Fatalf("List = %+v, %v", list, err)
	}
	if list[0].Digest != ds[0] || !list[0].InUse || list[1].InUse || list[0].SizeBytes != 1<<20 || list[1].SizeBytes != 2<<20 {
		t.Errorf("List = %+v; want %s first (used last, pinned)", list, ds[0][:8])
	}
	if !list[0].CachedAt.Equal(before.CachedAt) || !list[0].LastUsedAt.After(before.LastUsedAt) {
		t.Errorf("a use moved cached_at (%v → %v) or not last_used (%v → %v)", before.CachedAt, list[0].CachedAt, before.LastUsedAt, list[0].LastUsedAt)
	}

	if err := c.Delete(ds[0]); !errors.Is(err, ErrImageInUse) {
		t.Errorf("Delete(pinned) = %v, want ErrImageInUse", err)
	}
	release()
	release() // a second release does nothing
	if err := c.Delete(ds[0]); err != nil {
		t.Errorf("Delete after release = %v", err)
	}
	if c.Has(ds[0]) {
		t.Error("deleted image still cached")
	}
	if err := c.Delete(ds[0]); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Delete(absent) = %v, want fs.ErrNotExist", err)
	}
	if err := c.Delete("../../etc/passwd"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Delete(path) = %v, want fs.ErrNotExist", err)
	}
}

// With MaxTotalBytes, each download evicts the least recently used images
// that no provision holds, never the one just fetched nor a pinned one.
func TestCacheEvictsLeastRecentlyUsed(t *testing.T) {
	images, ds := sizedImages(t, 4) // 1, 2, 3, 4 MiB
	srv := cacheServer(t, images)
	dir := t.TempDir()
	c, err := NewCache(dir, CacheOptions{Client: srv.Client(), MaxTotalBytes: 6 << 20})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	fetch := func(d string) {
		t.Helper()
		if _, err := c.Fetch(ctx, srv.URL+"/"+d, d, nil); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond) // distinct use times
	}
	cached := func() (out []bool) {
		for _, d := range ds {
			out = append(out, c.Has(d))
		}
		return out
	}
	fetch(ds[0])
	fetch(ds[1])
	fetch(ds[0])            // 1 MiB image used again: 2 MiB one is now the oldest use
	release := c.Use(ds[1]) // ...but pinned
	fetch(ds[2])            // 1+2+3 = 6 MiB: fits
	if got := cached(); !got[0] || !got[1] || !got[2] {
		t.Fatalf("at the bound: cached %v", got)
	}
	fetch(ds[3]) // 10 MiB: the pinned 2 MiB one stays, so 1 then 3 go
	if got := cached(); got[0] || !got[1] || got[2] || !got[3] {
		t.Errorf("after eviction cached %v, want only the pinned one and the new one", got)
	}
	release()
	c.Evict() // 2+4 = 6 MiB fits: nothing more goes
	if got := cached(); !got[1] || !got[3] {
		t.Errorf("Evict removed what fits: %v", got)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("cache dir holds %d entries, want 2", len(ents))
	}
}
