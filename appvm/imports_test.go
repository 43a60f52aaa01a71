package appvm_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/disk"
	"vmhost/events"
	"vmhost/ociimage/ocitest"
	"vmhost/qcow2"
)

func requireMkfs(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
	return p
}

// importOptions are the options tests import with: as root, owners and
// devices are kept as in production; otherwise the test could not import.
func importOptions(t *testing.T) appvm.ImportOptions {
	return appvm.ImportOptions{Mkfs: requireMkfs(t), IgnoreOwners: os.Geteuid() != 0, SkipDevices: os.Geteuid() != 0}
}

// gatedMkfs returns a mkfs.ext4 wrapper that waits until open is called,
// so a test can look at an import in progress, and the function.
func gatedMkfs(t *testing.T) (string, func()) {
	t.Helper()
	real := requireMkfs(t)
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
	t.Cleanup(open) // never leave an import waiting
	return script, open
}

// testImage is a two-layer image whose second layer replaces and removes
// files of the first; version makes builds differ.
func testImage(t testing.TB, version string) ocitest.Image {
	return ocitest.Image{
		Layers: [][]byte{
			ocitest.Layer(t, ocitest.Dir("bin/", 0o755), ocitest.File("bin/app", "#!/bin/sh\necho v0\n", 0o755, 0, 0), ocitest.File("old.txt", "old", 0o644, 0, 0)),
			ocitest.Layer(t, ocitest.File("bin/app", "#!/bin/sh\necho "+version+"\n", 0o755, 0, 0), ocitest.Whiteout("old.txt")),
		},
		Config: ocitest.Config{
			Entrypoint: []string{"/bin/app"},
			Cmd:        []string{"--port", "80"},
			Env:        []string{"PATH=/bin", "VERSION=" + version},
			WorkingDir: "/srv",
			User:       "1000",
		},
	}
}

func dirNames(t *testing.T, dir string) []string {
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

// buildsDir is a temp dir for a catalog: builds committed there are
// sealed (immutable, as root), which TempDir's cleanup cannot remove.
func buildsDir(t testing.TB) string {
	dir := t.TempDir()
	t.Cleanup(func() {
		if err := disk.RemoveAll(dir); err != nil {
			t.Error(err)
		}
	})
	return dir
}

func TestImportFirstAndReady(t *testing.T) {
	dir := buildsDir(t)
	src := filepath.Join(dir, "app.tar")
	digest := testImage(t, "v1").WriteTar(t, src)
	cat := appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}
	mkfs, open := gatedMkfs(t)
	o := importOptions(t)
	o.Mkfs = mkfs
	o.Now = func() time.Time { return time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC) }
	evs := &published{}
	o.Events = evs
	imp := appvm.NewImporter(cat, o)
	defer imp.Close()

	started, err := imp.Start(&appvm.ImportRequest{ID: "app", Path: src})
	if err != nil {
		t.Fatal(err)
	}
	if started.Status != appvm.StatusImporting || started.BuildDigest != "" || started.Source != src {
		t.Errorf("Start = %+v, want status importing, no digest, source %s", started, src)
	}
	got, err := cat.Get("app")
	if err != nil || got.Status != appvm.StatusImporting {
		t.Fatalf("Get while importing = %+v, %v; want importing", got, err)
	}
	// One import per id: a second one, and a delete, wait their turn.
	var ce *appvm.ConflictError
	if _, err := imp.Start(&appvm.ImportRequest{ID: "app", Path: src}); !errors.As(err, &ce) {
		t.Errorf("second Start while importing = %v, want *ConflictError", err)
	}
	if err := imp.Delete("app", func(string) (appvm.ImageUsers, error) { return appvm.ImageUsers{}, nil }); !errors.As(err, &ce) {
		t.Errorf("Delete while importing = %v, want *ConflictError", err)
	}
	// So does a second Importer on the same catalog (another process).
	other := appvm.NewImporter(cat, o)
	if _, err := other.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: src}); !errors.As(err, &ce) {
		t.Errorf("Import by another importer while importing = %v, want *ConflictError", err)
	}
	open()
	imp.Wait()

	got, err = cat.Get("app")
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != appvm.StatusReady || got.BuildDigest != digest || got.Failure != "" || got.Reimport != nil {
		t.Errorf("after import = %+v, want ready with build_digest %s", got, digest)
	}
	if !slices.Equal(got.Entrypoint, []string{"/bin/app"}) || !slices.Equal(got.Cmd, []string{"--port", "80"}) ||
		!slices.Equal(got.Env, []string{"PATH=/bin", "VERSION=v1"}) || got.Workdir != "/srv" || got.User != "1000" {
		t.Errorf("workload = %+v", got.Workload)
	}
	if got.SizeBytes == 0 || !got.CreatedAt.Equal(o.Now()) {
		t.Errorf("size %d, created_at %v", got.SizeBytes, got.CreatedAt)
	}
	h, err := qcow2.ReadHeaderFile(cat.RootFS(got))
	if err != nil {
		t.Fatalf("rootfs: %v", err)
	}
	if h.Size != got.SizeBytes {
		t.Errorf("rootfs virtual size %d, catalog says %d", h.Size, got.SizeBytes)
	}
	build := "rootfs-" + strings.ReplaceAll(digest, ":", "-") + ".qcow2"
	if names := dirNames(t, filepath.Join(cat.Dir, "app")); !slices.Equal(names, []string{"image.json", build}) {
		t.Errorf("image dir holds %q, want only image.json and %s", names, build)
	}
	if got := evs.String(); got != "image_ready app \n" {
		t.Errorf("import published %q, want one image_ready of app", got)
	}
}

// published collects events.
type published struct {
	mu  sync.Mutex
	evs []events.Event
}

func (p *published) Publish(e events.Event) {
	p.mu.Lock()
	p.evs = append(p.evs, e)
	p.mu.Unlock()
}

// String is one "type image_id message" line per event.
func (p *published) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, e := range p.evs {
		fmt.Fprintf(&b, "%s %s %s\n", e.Type, e.ImageID, e.Message)
	}
	return b.String()
}

func TestImportBadArchiveFails(t *testing.T) {
	dir := buildsDir(t)
	cat := appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}
	o := importOptions(t)
	evs := &published{}
	o.Events = evs
	imp := appvm.NewImporter(cat, o)
	defer imp.Close()

	good := filepath.Join(dir, "good.tar")
	testImage(t, "v1").WriteTar(t, good)
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.tar")
	if err := os.WriteFile(truncated, data[:len(data)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	escaping := filepath.Join(dir, "escaping.tar")
	ocitest.Image{Layers: [][]byte{ocitest.Layer(t, ocitest.File("../evil", "x", 0o644, 0, 0))}}.WriteTar(t, escaping)

	for _, c := range []struct{ name, src, reason string }{
		{"truncated", truncated, "truncated"},
		{"escaping", escaping, "escapes the image root"},
	} {
		t.Run(c.name, func(t *testing.T) {
			id := "bad-" + c.name
			if _, err := imp.Start(&appvm.ImportRequest{ID: id, Path: c.src}); err != nil {
				t.Fatal(err)
			}
			imp.Wait()
			got, err := cat.Get(id)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != appvm.StatusFailed || !strings.Contains(got.Failure, c.reason) {
				t.Errorf("got %+v, want failed with a reason containing %q", got, c.reason)
			}
			if names := dirNames(t, filepath.Join(cat.Dir, id)); !slices.Equal(names, []string{"image.json"}) {
				t.Errorf("image dir holds %q after a failed import, want only image.json", names)
			}
			if _, err := os.Stat(filepath.Join(dir, "evil")); err == nil {
				t.Error("the escaping entry was written outside the image")
			}
			if got := evs.String(); !strings.HasPrefix(got, "image_failed "+id+" ") || !strings.Contains(got, c.reason) || strings.Count(got, "\n") != 1 {
				t.Errorf("failed import published %q, want one image_failed of %s naming %q", got, id, c.reason)
			}
			evs.mu.Lock()
			evs.evs = nil
			evs.mu.Unlock()
		})
	}
}

func TestImportRefusesBadRequests(t *testing.T) {
	dir := buildsDir(t)
	imp := appvm.NewImporter(appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}, importOptions(t))
	defer imp.Close()
	fifo := filepath.Join(dir, "fifo")
	if err := exec.Command("mkfifo", fifo).Run(); err != nil {
		t.Skip("mkfifo:", err)
	}
	for _, c := range []struct {
		req   appvm.ImportRequest
		field string
	}{
		{appvm.ImportRequest{ID: "../x", Path: dir}, "id"},
		{appvm.ImportRequest{ID: "", Path: dir}, "id"},
		{appvm.ImportRequest{ID: "a", Path: "relative/image.tar"}, "path"},
		{appvm.ImportRequest{ID: "a", Path: filepath.Join(dir, "missing.tar")}, "path"},
		{appvm.ImportRequest{ID: "a", Path: fifo}, "path"},
	} {
		_, err := imp.Start(&c.req)
		if err == nil || !strings.HasPrefix(err.Error(), c.field+": ") {
			t.Errorf("Start(%+v) = %v, want an error on %s", c.req, err, c.field)
		}
	}
	if names := dirNames(t, dir); slices.Contains(names, "appvm-images") && len(dirNames(t, filepath.Join(dir, "appvm-images"))) > 0 {
		t.Errorf("refused requests wrote into the catalog: %q", dirNames(t, filepath.Join(dir, "appvm-images")))
	}
}

func TestReimportKeepsServingOldBuild(t *testing.T) {
	dir := buildsDir(t)
	cat := appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}
	v1, v2 := filepath.Join(dir, "v1"), filepath.Join(dir, "v2.tar")
	d1 := testImage(t, "v1").WriteDir(t, v1)
	d2 := testImage(t, "v2").WriteTar(t, v2)
	imp := appvm.NewImporter(cat, importOptions(t))
	if _, err := imp.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: v1}); err != nil {
		t.Fatal(err)
	}
	oldFile := cat.RootFS(must(cat.Get("app")))
	oldRoot, err := os.ReadFile(oldFile)
	if err != nil {
		t.Fatal(err)
	}

	mkfs, open := gatedMkfs(t)
	o := importOptions(t)
	o.Mkfs = mkfs
	gated := appvm.NewImporter(cat, o)
	defer gated.Close()
	started, err := gated.Start(&appvm.ImportRequest{ID: "app", Path: v2})
	if err != nil {
		t.Fatal(err)
	}
	for _, got := range []*appvm.Image{started, must(cat.Get("app"))} {
		if got.Status != appvm.StatusReady || got.BuildDigest != d1 || got.Reimport == nil ||
			got.Reimport.Status != appvm.StatusImporting || got.Reimport.Source != v2 {
			t.Errorf("during re-import = %+v (reimport %+v), want ready with the old digest and reimport importing", got, got.Reimport)
		}
	}
	open()
	gated.Wait()
	got := must(cat.Get("app"))
	if got.Status != appvm.StatusReady || got.BuildDigest != d2 || got.Reimport != nil || got.Source != v2 ||
		!slices.Contains(got.Env, "VERSION=v2") {
		t.Errorf("after re-import = %+v, want ready with digest %s, no reimport", got, d2)
	}
	newFile := cat.RootFS(got)
	newRoot, err := os.ReadFile(newFile)
	if err != nil {
		t.Fatal(err)
	}
	if newFile == oldFile || string(newRoot) == string(oldRoot) {
		t.Errorf("the new build %s is not a new file beside %s", newFile, oldFile)
	}
	// The previous build stays (a create may have just read its digest),
	// byte for byte.
	if kept, err := os.ReadFile(oldFile); err != nil || string(kept) != string(oldRoot) {
		t.Errorf("the previous build %s did not stay: %v", oldFile, err)
	}
	// The file system is the new build's: the upper layer's app, the
	// whited-out file gone.
	if got := debugfsCat(t, newFile, "/bin/app"); got != "#!/bin/sh\necho v2\n" {
		t.Errorf("/bin/app in the re-imported rootfs = %q, want the v2 script", got)
	}
	if got := debugfsCat(t, newFile, "/old.txt"); got != "" {
		t.Errorf("/old.txt survived its whiteout: %q", got)
	}

	// A failed re-import leaves the current build in service.
	bad := filepath.Join(dir, "bad.tar")
	if err := os.WriteFile(bad, []byte("not a tar at all, far too short"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := imp.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: bad}); err == nil {
		t.Fatal("importing a bad archive succeeded")
	}
	got = must(cat.Get("app"))
	if got.Status != appvm.StatusReady || got.BuildDigest != d2 || got.Reimport == nil ||
		got.Reimport.Status != appvm.StatusFailed || got.Reimport.Failure == "" {
		t.Errorf("after failed re-import = %+v (reimport %+v), want ready %s with reimport failed", got, got.Reimport, d2)
	}
	if after, _ := os.ReadFile(cat.RootFS(got)); string(after) != string(newRoot) {
		t.Error("a failed re-import changed the current build")
	}
	if names := dirNames(t, filepath.Join(cat.Dir, "app")); !slices.Equal(names, slices.Sorted(slices.Values([]string{"image.json", filepath.Base(oldFile), filepath.Base(newFile)}))) {
		t.Errorf("image dir holds %q, want only image.json and the two builds", names)
	}
	// The first image again: its build (the same digest) is current again,
	// and the file already there is kept as it was (overlays may read
	// through to it), not replaced by the new import's. An Importer
	// without the agent's sweeps removes no build.
	if _, err := imp.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: v1}); err != nil {
		t.Fatal(err)
	}
	third := cat.RootFS(must(cat.Get("app")))
	if third != oldFile {
		t.Errorf("the first image imported again is at %s, want its build %s", third, oldFile)
	}
	if kept, err := os.ReadFile(third); err != nil || string(kept) != string(oldRoot) {
		t.Errorf("the build of the same digest was replaced by a new file: %v", err)
	}
	if names := dirNames(t, filepath.Join(cat.Dir, "app")); !slices.Equal(names, slices.Sorted(slices.Values([]string{"image.json", filepath.Base(oldFile), filepath.Base(newFile)}))) {
		t.Errorf("after a third import the image dir holds %q", names)
	}
	for _, b := range []string{oldFile, newFile} {
		if st, err := os.Stat(b); err != nil {
			t.Error(err)
		} else if st.Mode().Perm() != 0o444 {
			t.Errorf("build %s has mode %v, want it sealed read-only (0444)", b, st.Mode().Perm())
		}
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestRecoverInterruptedImports(t *testing.T) {
	dir := buildsDir(t)
	cat := appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	mkdir := func(p string) {
		if err := os.MkdirAll(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p, s string) {
		mkdir(filepath.Dir(p))
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// first: a first import cut short mid-layer.
	if err := cat.Put(&appvm.Image{ID: "first", Status: appvm.StatusImporting, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	mkdir(filepath.Join(cat.Dir, "first", ".next", ".import-123", "rootfs", "etc"))
	mkdir(filepath.Join(cat.Dir, "first", ".import-456"))
	// again: a re-import of a ready image cut short.
	ready := &appvm.Image{ID: "again", Status: appvm.StatusReady, CreatedAt: now}
	ready.BuildDigest = "sha256:old"
	ready.Reimport = &appvm.Reimport{Status: appvm.StatusImporting, StartedAt: now, Source: "/x.tar"}
	if err := cat.Put(ready); err != nil {
		t.Fatal(err)
	}
	write(filepath.Join(cat.Dir, "again", "rootfs.qcow2"), "old build")
	// staged: a crash after the staged image.json and the rootfs rename.
	st := &appvm.Image{ID: "staged", Status: appvm.StatusImporting, CreatedAt: now}
	if err := cat.Put(st); err != nil {
		t.Fatal(err)
	}
	write(filepath.Join(cat.Dir, "staged", "rootfs-sha256-new.qcow2"), "new build")
	b := `{"id":"staged","status":"ready","created_at":"2026-01-02T03:04:05Z","build_digest":"sha256:new"}`
	write(filepath.Join(cat.Dir, "staged", ".next", "image.json"), b)
	// busy: an import another process is running right now.
	if err := cat.Put(&appvm.Image{ID: "busy", Status: appvm.StatusImporting, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	mkdir(filepath.Join(cat.Dir, "busy", ".next"))
	mkfs, open := gatedMkfs(t)
	o := importOptions(t)
	o.Mkfs = mkfs
	runner := appvm.NewImporter(cat, o)
	src := filepath.Join(dir, "busy.tar")
	testImage(t, "v1").WriteTar(t, src)
	if _, err := runner.Start(&appvm.ImportRequest{ID: "busy", Path: src}); err != nil {
		t.Fatal(err)
	}
	// A delete cut short after its rename.
	mkdir(filepath.Join(cat.Dir, ".deleted-gone-1", "gone"))

	evs := &published{}
	if err := appvm.NewImporter(cat, appvm.ImportOptions{Events: evs}).Recover(); err != nil {
		t.Fatal(err)
	}
	want := "image_failed again " + appvm.InterruptedReason + "\nimage_failed first " + appvm.InterruptedReason + "\nimage_ready staged \n"
	if got := evs.String(); got != want {
		t.Errorf("recovery published\n%s\nwant\n%s", got, want)
	}
	if got := must(cat.Get("first")); got.Status != appvm.StatusFailed || got.Failure != appvm.InterruptedReason {
		t.Errorf("first = %+v, want failed: %s", got, appvm.InterruptedReason)
	}
	if names := dirNames(t, filepath.Join(cat.Dir, "first")); !slices.Equal(names, []string{"image.json"}) {
		t.Errorf("first holds %q after recovery, want only image.json", names)
	}
	if got := must(cat.Get("again")); got.Status != appvm.StatusReady || got.BuildDigest != "sha256:old" ||
		got.Reimport == nil || got.Reimport.Status != appvm.StatusFailed || got.Reimport.Failure != appvm.InterruptedReason {
		t.Errorf("again = %+v (reimport %+v), want ready sha256:old with reimport failed", got, got.Reimport)
	}
	if got := must(cat.Get("staged")); got.Status != appvm.StatusReady || got.BuildDigest != "sha256:new" {
		t.Errorf("staged = %+v, want the staged build committed", got)
	}
	if names := dirNames(t, filepath.Join(cat.Dir, "staged")); !slices.Equal(names, []string{"image.json", "rootfs-sha256-new.qcow2"}) {
		t.Errorf("staged holds %q after recovery", names)
	}
	if got := must(cat.Get("busy")); got.Status != appvm.StatusImporting {
		t.Errorf("busy = %+v: recovery touched an import that is running", got)
	}
	if _, err := os.Stat(filepath.Join(cat.Dir, ".deleted-gone-1")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a half-deleted image dir survived recovery: %v", err)
	}
	open()
	runner.Wait()
	if got := must(cat.Get("busy")); got.Status != appvm.StatusReady {
		t.Errorf("busy after its import = %+v, want ready", got)
	}
}

func TestDeleteImage(t *testing.T) {
	dir := buildsDir(t)
	cat := appvm.Catalog{Dir: filepath.Join(dir, "appvm-images")}
	src := filepath.Join(dir, "img")
	testImage(t, "v1").WriteDir(t, src)
	imp := appvm.NewImporter(cat, importOptions(t))
	if _, err := imp.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: src}); err != nil {
		t.Fatal(err)
	}
	var ce *appvm.ConflictError
	err := imp.Delete("app", func(id string) (appvm.ImageUsers, error) {
		return appvm.ImageUsers{AppVMs: []string{"vm2", "vm1"}}, nil
	})
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "vm1, vm2") {
		t.Errorf("Delete of a used image = %v, want a *ConflictError naming vm1, vm2", err)
	}
	if _, err := cat.Get("app"); err != nil {
		t.Fatalf("a refused delete removed the image: %v", err)
	}
	if err := imp.Delete("app", func(string) (appvm.ImageUsers, error) { return appvm.ImageUsers{}, nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := cat.Get("app"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Get after delete = %v, want not found", err)
	}
	if names := dirNames(t, cat.Dir); len(names) != 0 {
		t.Errorf("catalog holds %q after the delete, want nothing", names)
	}
	if err := imp.Delete("app", func(string) (appvm.ImageUsers, error) { return appvm.ImageUsers{}, nil }); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("second Delete = %v, want not found", err)
	}
	// The id can be imported again.
	if _, err := imp.Import(context.Background(), &appvm.ImportRequest{ID: "app", Path: src}); err != nil {
		t.Fatal(err)
	}
	list, err := cat.List()
	if err != nil || len(list) != 1 || list[0].ID != "app" {
		t.Errorf("List = %v, %v; want [app]", list, err)
	}
}

// debugfsCat returns the contents of p in the ext4 file system inside the
// qcow2 image, empty when p does not exist.
func debugfsCat(t *testing.T, qcow, p string) string {
	t.Helper()
	for _, tool := range []string{"qemu-img", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (apt-get install qemu-utils e2fsprogs)", tool)
		}
	}
	raw := filepath.Join(t.TempDir(), "rootfs.raw")
	if out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", qcow, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v: %s", err, out)
	}
	out, err := exec.Command("debugfs", "-R", "cat "+p, raw).Output()
	if err != nil {
		t.Fatalf("debugfs: %v", err)
	}
	return string(out)
}
