package registry

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
)

func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func readFixture(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// The Ubuntu released download stream, trimmed to five products: qcow2
// disks are listed (disk1.img preferred to disk-kvm.img), root.tar.xz,
// squashfs, manifest and lxd.tar.xz items are not, and fetch_url is the
// mirror root joined with the item path.
func TestParseUbuntuStream(t *testing.T) {
	const loc = "https://mirror.example/ubuntu/streams/v1/com.ubuntu.cloud:released:download.json"
	images, err := Parse(readFixture(t, "com.ubuntu.cloud_released_download.json"), loc)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Image{}
	for _, im := range images {
		got[im.ImageID] = im
	}
	const noble = "server/releases/noble/release-20251101/ubuntu-24.04-server-cloudimg-amd64.img"
	want := Image{
		ImageID:       "com.ubuntu.cloud:server:24.04:amd64:20251101",
		ContentSHA256: digest(noble),
		FetchURL:      "https://mirror.example/ubuntu/" + noble,
		Distro:        "ubuntu", Version: "noble", Arch: "amd64", SizeBytes: 598_000_000,
		Source: loc,
	}
	if g := got[want.ImageID]; !reflect.DeepEqual(g, want) {
		t.Errorf("noble amd64:\n got %+v\nwant %+v", g, want)
	}
	const jammy = "server/releases/jammy/release-20251030/ubuntu-22.04-server-cloudimg-amd64-disk-kvm.img"
	if g := got["com.ubuntu.cloud:server:22.04:amd64:20251030"]; g.FetchURL != "https://mirror.example/ubuntu/"+jammy || g.ContentSHA256 != digest(jammy) {
		t.Errorf("a version with only disk-kvm.img: %+v", g)
	}
	var ids []string
	for id := range got {
		ids = append(ids, id)
	}
	wantIDs := []string{
		"com.ubuntu.cloud:server:22.04:amd64:20251030",
		"com.ubuntu.cloud:server:24.04:amd64:20251014",
		"com.ubuntu.cloud:server:24.04:amd64:20251101",
		"com.ubuntu.cloud:server:24.04:arm64:20251101",
	}
	if len(images) != len(wantIDs) {
		t.Errorf("ids = %q, want %q (10.10 has no qcow2 disk)", ids, wantIDs)
	}
	for _, id := range wantIDs {
		if _, ok := got[id]; !ok {
			t.Errorf("%s missing from %q", id, ids)
		}
	}
}

// An Incus/LXD image server's stream: the VM disk is disk.qcow2 of ftype
// disk-kvm.img; a product with only a container rootfs is skipped; the
// mirror root of an index not under streams/v1 is its directory.
func TestParseIncusStream(t *testing.T) {
	images, err := Parse(readFixture(t, "incus_images.json"), "http://images.example:8080/streams/v1/images.json?token=abc")
	if err != nil {
		t.Fatal(err)
	}
	if len(images) != 1 {
		t.Fatalf("images = %+v, want only the debian VM image", images)
	}
	im := images[0]
	if im.ImageID != "debian:bookworm:amd64:cloud:20251101_05:24" || im.Distro != "Debian" || im.Version != "bookworm" ||
		im.FetchURL != "http://images.example:8080/images/debian/bookworm/amd64/cloud/20251101_05:24/disk.qcow2" ||
		im.ContentSHA256 != digest("deb-disk") || im.Source != "http://images.example:8080/streams/v1/images.json?REDACTED" {
		t.Errorf("debian: %+v", im)
	}
	if got := mirrorRoot("https://u:p@host/mirror/index.json?x=1"); got != "https://host/mirror/" {
		t.Errorf("mirrorRoot = %q", got)
	}
}

func TestParseFlat(t *testing.T) {
	body := `{"images": [
		{"image_id": "debian-12", "distro": "debian", "version": "12", "arch": "amd64", "content_sha256": "` + strings.ToUpper(digest("d12")) + `", "fetch_url": "https://img.example/debian-12.qcow2", "size_bytes": 400},
		{"image_id": "no-digest", "content_sha256": "abc", "fetch_url": "https://img.example/x.qcow2"},
		{"image_id": "ftp", "content_sha256": "` + digest("f") + `", "fetch_url": "ftp://img.example/x.qcow2"},
		{"image_id": "", "content_sha256": "` + digest("e") + `", "fetch_url": "https://img.example/e.qcow2"}
	]}`
	images, err := Parse([]byte(body), "/srv/images/index.json")
	if err != nil {
		t.Fatal(err)
	}
	want := []Image{{ImageID: "debian-12", Distro: "debian", Version: "12", Arch: "amd64", ContentSHA256: digest("d12"),
		FetchURL: "https://img.example/debian-12.qcow2", SizeBytes: 400, Source: "/srv/images/index.json"}}
	if !reflect.DeepEqual(images, want) {
		t.Errorf("Parse = %+v\nwant %+v", images, want)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`not json`, "index is not JSON"},
		{`{"format": "index:1.0", "index": {}}`, "index:1.0 document lists other documents"},
		{`{"hello": 1}`, "neither a SimpleStreams products:1.0 document nor a vmhost index"},
		{`{"format": "products:1.0", "products": []}`, "reading products:1.0 document"},
	} {
		if _, err := Parse([]byte(tc.body), "/x.json"); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%s) = %v, want %q", tc.body, err, tc.want)
		}
	}
	// A products document read from a file has no mirror URL for its
	// relative paths: nothing in it can be fetched.
	images, err := Parse(readFixture(t, "incus_images.json"), "/srv/mirror/streams/v1/images.json")
	if err != nil || len(images) != 0 {
		t.Errorf("file products index = %+v, %v; want nothing listed", images, err)
	}
}

// An index that stops answering keeps its last good content; the failure
// is logged once per streak, with the URL's credentials removed; two
// indexes merge with the first one winning an id.
func TestRegistryRefreshKeepsLastGood(t *testing.T) {
	var failing atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(w, "down", http.StatusBadGateway)
			return
		}
		w.Write(readFixture(t, "com.ubuntu.cloud_released_download.json"))
	}))
	defer srv.Close()
	flat := filepath.Join(t.TempDir(), "index.json")
	os.WriteFile(flat, []byte(`{"images": [{"image_id": "com.ubuntu.cloud:server:24.04:amd64:20251101", "content_sha256": "`+digest("other")+`", "fetch_url": "https://other.example/x.qcow2"}, {"image_id": "local", "content_sha256": "`+digest("l")+`", "fetch_url": "http://10.0.0.1/local.qcow2"}]}`), 0o600)

	var logs bytes.Buffer
	secretURL := strings.Replace(srv.URL, "http://", "http://admin:hunter2@", 1) + "/streams/v1/download.json?key=s3cret"
	r := New([]string{secretURL, flat}, srv.Client(), slog.New(slog.NewTextHandler(&logs, nil)))
	if err := r.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	list := r.List()
	if len(list) != 5 || list[0].ImageID != "com.ubuntu.cloud:server:22.04:amd64:20251030" || list[4].ImageID != "local" {
		t.Fatalf("List = %+v", list)
	}
	first, ok := r.Get("com.ubuntu.cloud:server:24.04:amd64:20251101")
	if !ok || !strings.HasPrefix(first.FetchURL, srv.URL+"/server/") || strings.Contains(first.Source, "hunter2") || strings.Contains(first.Source, "s3cret") {
		t.Errorf("first index should win and show no credentials: %+v", first)
	}

	failing.Store(true)
	for range 3 {
		if err := r.Refresh(context.Background()); err == nil || !strings.Contains(err.Error(), "502") {
			t.Errorf("Refresh = %v, want the 502", err)
		}
	}
	if got := r.List(); len(got) != 5 {
		t.Errorf("after failures List has %d images, want the last good 5", len(got))
	}
	if n := strings.Count(logs.String(), "cannot be read"); n != 1 {
		t.Errorf("failure logged %d times in one streak, want 1:\n%s", n, logs.String())
	}
	failing.Store(false)
	r.Refresh(context.Background())
	failing.Store(true)
	r.Refresh(context.Background())
	if n := strings.Count(logs.String(), "cannot be read"); n != 2 || !strings.Contains(logs.String(), "readable again") {
		t.Errorf("a new streak must be logged again:\n%s", logs.String())
	}
	if strings.Contains(logs.String(), "hunter2") || strings.Contains(logs.String(), "s3cret") {
		t.Errorf("log shows credentials:\n%s", logs.String())
	}

	// An unreachable index at start: empty, logged, no credentials.
	logs.Reset()
	r = New([]string{"http://u:hunter2@127.0.0.1:1/streams/v1/x.json"}, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	err := r.Refresh(context.Background())
	if err == nil || strings.Contains(err.Error(), "hunter2") || len(r.List()) != 0 {
		t.Errorf("unreachable: %v, %v", err, r.List())
	}
	if strings.Contains(logs.String(), "hunter2") || !strings.Contains(logs.String(), "http://127.0.0.1:1/streams/v1/x.json") {
		t.Errorf("log: %s", logs.String())
	}
}
