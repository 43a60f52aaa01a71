package api

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"vmhost/appvm"
	"vmhost/auth"
	"vmhost/ociimage/ocitest"
)

// withImporter rebuilds the harness's server with an Importer of its own:
// as non-root, owners and devices are ignored (else no import could
// succeed); gate, when set, is a mkfs.ext4 that waits for its gate file.
func (h *harness) withImporter(t *testing.T, mkfs string) {
	t.Helper()
	if mkfs == "" {
		var err error
		if mkfs, err = exec.LookPath("mkfs.ext4"); err != nil {
			t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
		}
	}
	keys, err := auth.Open(h.keysPath)
	if err != nil {
		t.Fatal(err)
	}
	imp := appvm.NewImporter(h.apps.Catalog(), appvm.ImportOptions{
		Mkfs: mkfs, IgnoreOwners: os.Geteuid() != 0, SkipDevices: os.Geteuid() != 0,
	})
	t.Cleanup(imp.Close)
	h.srv = New(Config{Keys: keys, VMs: h.vms, AppVMs: h.apps, Images: imp, Logger: slog.New(slog.NewTextHandler(&logBuf, nil))})
}

// gatedMkfs is a mkfs.ext4 that waits until open is called, so a test can
// act while an import is in progress.
func gatedMkfs(t *testing.T) (string, func()) {
	t.Helper()
	real, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
	dir := t.TempDir()
	gate := filepath.Join(dir, "gate")
	script := filepath.Join(dir, "mkfs.ext4")
	body := "#!/bin/sh\nwhile [ ! -e '" + gate + "' ]; do sleep 0.02; done\nexec '" + real + "' \"$@\"\n"
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	open := func() {
		if err := os.WriteFile(gate, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(open)
	return script, open
}

func appImage(t *testing.T, version string) ocitest.Image {
	return ocitest.Image{
		Layers: [][]byte{ocitest.Layer(t,
			ocitest.Dir("srv/", 0o755),
			ocitest.File("srv/version", version+"\n", 0o644, 0, 0),
		)},
		Config: ocitest.Config{
			Entrypoint: []string{"/bin/server"},
			Cmd:        []string{"--listen", ":80"},
			Env:        []string{"PATH=/bin", "VERSION=" + version},
			WorkingDir: "/srv",
			User:       "daemon",
		},
	}
}

func decodeImage(t *testing.T, body string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, body)
	}
	return m
}

func TestImageImportOverAPI(t *testing.T) {
	h := newHarness(t)
	mkfs, open := gatedMkfs(t)
	h.withImporter(t, mkfs)
	dir := t.TempDir()
	src := filepath.Join(dir, "layout")
	digest := appImage(t, "v1").WriteDir(t, src)

	st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"nginx","path":%q}`, src))
	if st != 202 {
		t.Fatalf("POST = %d %s, want 202", st, b)
	}
	if m := decodeImage(t, b); m["id"] != "nginx" || m["status"] != "importing" || m["build_digest"] != nil || m["source"] != src {
		t.Errorf("POST body = %s, want nginx importing without build_digest", b)
	}
	// While it imports: a second import, a delete and an AppVM create
	// all answer 409 CONFLICT.
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/api/appvm/images", fmt.Sprintf(`{"id":"nginx","path":%q}`, src)},
		{"DELETE", "/api/appvm/images/nginx", ""},
		{"POST", "/api/appvm/vms", `{"vm_id":"early","image_id":"nginx","vcpus":1,"memory_mb":64,"disk_gib":1}`},
	} {
		if st, _, b := h.do(t, c.method, c.path, h.rw, c.body); st != 409 || !strings.Contains(b, `"code":"CONFLICT"`) {
			t.Errorf("%s %s while importing = %d %s, want 409 CONFLICT", c.method, c.path, st, b)
		}
	}
	if st, _, b := h.do(t, "GET", "/api/appvm/images/nginx", h.ro, ""); st != 200 || decodeImage(t, b)["status"] != "importing" {
		t.Errorf("GET while importing = %d %s", st, b)
	}
	open()
	h.srv.images.Wait()

	st, _, b = h.do(t, "GET", "/api/appvm/images/nginx", h.ro, "")
	if st != 200 {
		t.Fatalf("GET = %d %s", st, b)
	}
	m := decodeImage(t, b)
	want := map[string]any{
		"id": "nginx", "status": "ready", "build_digest": digest, "source": src,
		"entrypoint": []any{"/bin/server"}, "cmd": []any{"--listen", ":80"},
		"env": []any{"PATH=/bin", "VERSION=v1"}, "workdir": "/srv", "user": "daemon",
	}
	for k, v := range want {
		if fmt.Sprint(m[k]) != fmt.Sprint(v) {
			t.Errorf("image %s = %v, want %v", k, m[k], v)
		}
	}
	for _, k := range []string{"failure", "reimport", "healthcheck"} {
		if _, ok := m[k]; ok {
			t.Errorf("image has %s, which must be omitted here: %s", k, b)
		}
	}
	if size, _ := m["size_bytes"].(float64); size <= 0 || m["created_at"] == nil {
		t.Errorf("size_bytes %v, created_at %v", m["size_bytes"], m["created_at"])
	}

	st, _, b = h.do(t, "GET", "/api/appvm/images", h.ro, "")
	var list struct {
		Images []map[string]any `json:"images"`
	}
	if err := json.Unmarshal([]byte(b), &list); st != 200 || err != nil {
		t.Fatalf("GET list = %d %s (%v)", st, b, err)
	}
	var ids []string
	for _, im := range list.Images {
		ids = append(ids, im["id"].(string))
	}
	if !slices.Equal(ids, []string{"nginx", "pending", "plain", "web"}) {
		t.Errorf("listed ids = %q, want nginx, pending, plain, web", ids)
	}

	// The image is usable now.
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"app1","image_id":"nginx","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("create from the imported image = %d %s", st, b)
	}
	if st, _, b := h.do(t, "GET", "/api/appvm/vms/app1", h.ro, ""); st != 200 ||
		!strings.Contains(b, `"build_digest":"`+digest+`"`) || strings.Contains(b, "update_available") {
		t.Errorf("AppVM view = %d %s, want build_digest %s and no update_available", st, b, digest)
	}
	if st, _, b := h.do(t, "GET", "/api/appvm/images/nope", h.ro, ""); st != 404 || !strings.Contains(b, CodeNotFound) {
		t.Errorf("GET unknown image = %d %s", st, b)
	}
}

func TestImageImportFailsOverAPI(t *testing.T) {
	h := newHarness(t)
	h.withImporter(t, "")
	dir := t.TempDir()
	good := filepath.Join(dir, "good.tar")
	appImage(t, "v1").WriteTar(t, good)
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.tar")
	if err := os.WriteFile(truncated, data[:len(data)*2/3], 0o644); err != nil {
		t.Fatal(err)
	}
	// A layer that tries to write through a symlink to a host directory.
	outside := t.TempDir()
	escaping := filepath.Join(dir, "escaping.tar")
	ocitest.Image{Layers: [][]byte{ocitest.Layer(t,
		ocitest.Symlink("etc", outside),
		ocitest.File("etc/planted", "x", 0o644, 0, 0),
	)}}.WriteTar(t, escaping)

	for _, c := range []struct{ id, src, reason string }{
		{"cut", truncated, "truncated"},
		{"escape", escaping, "escapes the image root"},
	} {
		t.Run(c.id, func(t *testing.T) {
			if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":%q,"path":%q}`, c.id, c.src)); st != 202 {
				t.Fatalf("POST = %d %s", st, b)
			}
			h.srv.images.Wait()
			st, _, b := h.do(t, "GET", "/api/appvm/images/"+c.id, h.ro, "")
			m := decodeImage(t, b)
			if st != 200 || m["status"] != "failed" || !strings.Contains(fmt.Sprint(m["failure"]), c.reason) {
				t.Errorf("GET = %d %s, want failed with a reason containing %q", st, b, c.reason)
			}
			ents, err := os.ReadDir(filepath.Join(h.e.StateDir, "appvm-images", c.id))
			if err != nil {
				t.Fatal(err)
			}
			if len(ents) != 1 || ents[0].Name() != "image.json" {
				var names []string
				for _, e := range ents {
					names = append(names, e.Name())
				}
				t.Errorf("image dir holds %q after a failed import, want only image.json", names)
			}
			if ents, _ := os.ReadDir(outside); len(ents) != 0 {
				t.Errorf("the import wrote outside its root: %s holds %d entries", outside, len(ents))
			}
			// A failed image cannot be used: 400 on create.
			if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, fmt.Sprintf(`{"image_id":%q,"vcpus":1,"memory_mb":64,"disk_gib":1}`, c.id)); st != 400 {
				t.Errorf("create from a failed image = %d %s, want 400", st, b)
			}
		})
	}

	for _, c := range []struct {
		body   string
		status int
		field  string
	}{
		{`{"id":"../x","path":"` + good + `"}`, 400, "id: "},
		{`{"id":"x","path":"relative.tar"}`, 400, "path: "},
		{`{"id":"x","path":"` + filepath.Join(dir, "missing.tar") + `"}`, 400, "path: "},
		{`{"id":"x"}`, 422, "path: "},
		{`{"id":"x","path":"` + good + `","ref":"latest"}`, 422, `unknown field "ref"`},
		{`{"id":7,"path":"` + good + `"}`, 422, "id: "},
	} {
		st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, c.body)
		if st != c.status || !strings.Contains(b, c.field) {
			t.Errorf("POST %s = %d %s, want %d naming %s", c.body, st, b, c.status, c.field)
		}
	}
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "appvm-images", "x")); err == nil {
		t.Error("a refused POST created a catalog entry")
	}
}

func TestImageDeleteAndUpdateAvailable(t *testing.T) {
	h := newHarness(t)
	h.withImporter(t, "")
	dir := t.TempDir()
	v1, v2 := filepath.Join(dir, "v1.tar"), filepath.Join(dir, "v2")
	d1 := appImage(t, "v1").WriteTar(t, v1)
	d2 := appImage(t, "v2").WriteDir(t, v2)
	post := func(src string) {
		t.Helper()
		if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"app","path":%q}`, src)); st != 202 {
			t.Fatalf("POST = %d %s", st, b)
		}
		h.srv.images.Wait()
	}
	post(v1)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"old","image_id":"app","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("create = %d %s", st, b)
	}
	post(v2)
	st, _, b := h.do(t, "GET", "/api/appvm/images/app", h.ro, "")
	if m := decodeImage(t, b); st != 200 || m["build_digest"] != d2 || m["reimport"] != nil {
		t.Fatalf("after re-import = %d %s, want build_digest %s", st, b, d2)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"new","image_id":"app","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("create = %d %s", st, b)
	}
	for _, c := range []struct {
		id, digest string
		update     bool
	}{{"old", d1, true}, {"new", d2, false}} {
		_, _, b := h.do(t, "GET", "/api/appvm/vms/"+c.id, h.ro, "")
		var v struct {
			AppVM map[string]any `json:"appvm"`
		}
		if err := json.Unmarshal([]byte(b), &v); err != nil {
			t.Fatal(err)
		}
		_, has := v.AppVM["update_available"]
		if v.AppVM["build_digest"] != c.digest || has != c.update || (has && v.AppVM["update_available"] != true) {
			t.Errorf("AppVM %s: build_digest %v, update_available %v; want %s, %v", c.id, v.AppVM["build_digest"], v.AppVM["update_available"], c.digest, c.update)
		}
	}
	// The list view derives it too.
	if _, _, b := h.do(t, "GET", "/api/appvm/vms", h.ro, ""); strings.Count(b, `"update_available":true`) != 1 {
		t.Errorf("AppVM list should show update_available once: %s", b)
	}

	// Delete: refused while AppVMs use the image, 404 when unknown.
	st, _, b = h.do(t, "DELETE", "/api/appvm/images/app", h.rw, "")
	if st != 409 || !strings.Contains(b, `"code":"CONFLICT"`) || !strings.Contains(b, "new, old") {
		t.Errorf("DELETE of a used image = %d %s, want 409 CONFLICT naming new, old", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/appvm/images/nope", h.rw, ""); st != 404 || !strings.Contains(b, CodeNotFound) {
		t.Errorf("DELETE unknown = %d %s, want 404", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/appvm/images/app", h.ro, ""); st != 403 {
		t.Errorf("DELETE with a read key = %d %s, want 403", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/appvm/images/plain", h.rw, ""); st != 204 || b != "" {
		t.Errorf("DELETE of an unused image = %d %q, want 204 and no body", st, b)
	}
	if st, _, _ := h.do(t, "GET", "/api/appvm/images/plain", h.ro, ""); st != 404 {
		t.Errorf("GET after DELETE = %d, want 404", st)
	}
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "appvm-images", "plain")); err == nil {
		t.Error("the deleted image's directory is still there")
	}
}

func TestImportInterruptedByRestart(t *testing.T) {
	h := newHarness(t)
	// "pending" is importing with no import running: what a killed agent
	// leaves. A restarted agent's API (default Importer) recovers it.
	work := filepath.Join(h.e.StateDir, "appvm-images", "pending", ".next", ".import-1")
	if err := os.MkdirAll(work, 0o700); err != nil {
		t.Fatal(err)
	}
	h.start(t)
	st, _, b := h.do(t, "GET", "/api/appvm/images/pending", h.ro, "")
	if m := decodeImage(t, b); st != 200 || m["status"] != "failed" || m["failure"] != appvm.InterruptedReason {
		t.Errorf("after restart = %d %s, want failed: %s", st, b, appvm.InterruptedReason)
	}
	if _, err := os.Stat(filepath.Dir(work)); err == nil {
		t.Error("the interrupted import's work dir survived the restart")
	}
}

// TestCreateDuringReimport: a re-import of a ready image keeps it ready, so
// creates go on from the current build; only a first import is a 409.
func TestCreateDuringReimport(t *testing.T) {
	h := newHarness(t)
	h.withImporter(t, "")
	dir := t.TempDir()
	v1, v2 := filepath.Join(dir, "v1"), filepath.Join(dir, "v2")
	d1 := appImage(t, "v1").WriteDir(t, v1)
	appImage(t, "v2").WriteDir(t, v2)
	if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"app","path":%q}`, v1)); st != 202 {
		t.Fatalf("POST = %d %s", st, b)
	}
	h.srv.images.Wait()

	mkfs, open := gatedMkfs(t)
	h.withImporter(t, mkfs)
	st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"app","path":%q}`, v2))
	m := decodeImage(t, b)
	re, _ := m["reimport"].(map[string]any)
	if st != 202 || m["status"] != "ready" || m["build_digest"] != d1 || re["status"] != "importing" || re["source"] != v2 {
		t.Fatalf("POST re-import = %d %s, want 202, ready %s, reimport importing from %s", st, b, d1, v2)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"app","path":%q}`, v2)); st != 409 {
		t.Errorf("second re-import while one runs = %d %s, want 409", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"during","image_id":"app","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Errorf("create during a re-import = %d %s, want 201 from the current build", st, b)
	}
	open()
	h.srv.images.Wait()
	_, _, b = h.do(t, "GET", "/api/appvm/vms/during", h.ro, "")
	if !strings.Contains(b, `"build_digest":"`+d1+`"`) || !strings.Contains(b, `"update_available":true`) {
		t.Errorf("AppVM created during the re-import = %s, want build_digest %s and update_available", b, d1)
	}
}
