//go:build linux

package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"vmhost/config"
)

// TestRegistryCreateAndCache: through the real binary, a SimpleStreams
// mirror (index and images over HTTP, the index URL carrying credentials)
// lists its qcow2 disks; a create names one exactly as listed; the
// download lands in the cache, which lists it with the registry id; the
// image cache bound evicts the least recently used image after the next
// download, and an unreachable index leaves the agent serving.
func TestRegistryCreateAndCache(t *testing.T) {
	f := newFixture(t)
	base, err := os.ReadFile(f.base)
	if err != nil {
		t.Fatal(err)
	}
	// Two distinct images of one MiB (the blank qcow2, padded).
	images := map[string][]byte{}
	var digests []string
	for i := range 2 {
		b := append(append([]byte{}, base...), make([]byte, 1<<20-len(base))...)
		b[len(b)-1] = byte(i + 1)
		sum := sha256.Sum256(b)
		d := hex.EncodeToString(sum[:])
		images["/server/img"+fmt.Sprint(i)+".img"] = b
		digests = append(digests, d)
	}
	index := `{"format":"products:1.0","content_id":"com.example:download","products":{` +
		`"com.example:server:1:amd64":{"os":"exampleos","release":"one","arch":"amd64","versions":{` +
		`"20251101":{"items":{"disk1.img":{"ftype":"disk1.img","path":"server/img0.img","sha256":"` + digests[0] + `","size":1048576},` +
		`"root.tar.xz":{"ftype":"root.tar.xz","path":"server/root.tar.xz","sha256":"` + strings.Repeat("ab", 32) + `","size":7}}},` +
		`"20251102":{"items":{"disk1.img":{"ftype":"disk1.img","path":"server/img1.img","sha256":"` + digests[1] + `","size":1048576}}}}}}}`
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/streams/v1/download.json" {
			w.Write([]byte(index))
			return
		}
		if b, ok := images[r.URL.Path]; ok {
			w.Write(b)
			return
		}
		http.NotFound(w, r)
	}))
	defer mirror.Close()
	indexURL := strings.Replace(mirror.URL, "http://", "http://reader:s3cr3t@", 1) + "/streams/v1/download.json"

	s := startServer(t, serverOpts{edit: func(c *config.Config) {
		c.Registry.Indexes = []string{indexURL, "http://127.0.0.1:1/streams/v1/down.json"}
		c.FetchDeny = []string{} // the mirror is on loopback
		c.ImageCacheMaxBytes = 1<<20 + 512<<10
	}})
	var list struct {
		Images []map[string]any `json:"images"`
	}
	for i := 0; ; i++ { // the first read runs in the background
		st, b := s.do("GET", "/api/registry/images", "")
		if st != 200 || json.Unmarshal(b, &list) != nil {
			t.Fatalf("GET /api/registry/images = %d %s", st, b)
		}
		if len(list.Images) == 2 || i == 200 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(list.Images) != 2 {
		t.Fatalf("registry images = %v, want the two disk images", list.Images)
	}
	im := list.Images[0]
	if im["image_id"] != "com.example:server:1:amd64:20251101" || im["fetch_url"] != mirror.URL+"/server/img0.img" ||
		im["content_sha256"] != digests[0] || im["distro"] != "exampleos" || im["version"] != "one" || im["cached"] != false {
		t.Errorf("registry image = %v", im)
	}
	if out := s.stderr.String(); strings.Contains(out, "s3cr3t") || !strings.Contains(out, "registry index cannot be read") {
		t.Errorf("agent log shows index credentials or misses the unreachable index:\n%s", out)
	}

	create := func(id string, im map[string]any) {
		t.Helper()
		img, _ := json.Marshal(map[string]any{"image_id": im["image_id"], "content_sha256": im["content_sha256"], "fetch_url": im["fetch_url"]})
		s.create(`{"vm_id":"`+id+`","vcpus":1,"memory_mb":128,"kernel_path":"`+f.kernel+`","disk":{"size_gib":1},"image":`+string(img)+`}`, http.StatusAccepted)
		s.waitDisplay(id, "created", "created")
	}
	create("r0", list.Images[0])
	st, b := s.do("GET", "/api/images/cache", "")
	if st != 200 || !strings.Contains(string(b), `"digest":"`+digests[0]+`"`) || !strings.Contains(string(b), `"registry_image_ids":["com.example:server:1:amd64:20251101"]`) {
		t.Errorf("GET /api/images/cache = %d %s", st, b)
	}
	if _, b := s.do("GET", "/api/registry/images/com.example:server:1:amd64:20251101", ""); !strings.Contains(string(b), `"cached":true`) {
		t.Errorf("after the download: %s", b)
	}
	// A second image passes the bound: the first, used least recently and
	// by no provision, is evicted.
	create("r1", list.Images[1])
	st, b = s.do("GET", "/api/images/cache", "")
	if st != 200 || strings.Contains(string(b), digests[0]) || !strings.Contains(string(b), digests[1]) {
		t.Errorf("after the second download the cache = %s, want only %s", b, digests[1][:12])
	}
	if st, b := s.do("DELETE", "/api/images/cache/"+digests[0], ""); st != http.StatusNotFound {
		t.Errorf("DELETE evicted = %d %s", st, b)
	}
	if st, b := s.do("DELETE", "/api/images/cache/"+digests[1], ""); st != http.StatusNoContent {
		t.Errorf("DELETE = %d %s", st, b)
	}
	// The VMs made from them are untouched: their root disks are copies.
	if v, _ := s.get("r0"); v.DiskPath == "" || !exists(v.DiskPath) {
		t.Errorf("r0 after its image was evicted: %+v", v)
	}
}
