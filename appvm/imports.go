package appvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/disk"
	"vmhost/events"
	"vmhost/internal/atomicfile"
	"vmhost/ociimage"
	"vmhost/store"
	"vmhost/vm"
)

// ImportRequest is the body of POST /api/appvm/images: the image id and the
// absolute host path of an OCI image layout (directory or tar) or a docker
// save tarball.
type ImportRequest struct {
	ID   string `json:"id" decode:"required"`
	Path string `json:"path" decode:"required"`
}

// InterruptedReason is the failure of an import whose process ended before
// it finished; Importer.Recover records it.
const InterruptedReason = "import interrupted by agent restart"

// ImportOptions tune an Importer. The zero value imports as vmhost serve
// does: owners and device nodes kept (which needs root), mkfs.ext4 from
// PATH.
type ImportOptions struct {
	// Mkfs is the mkfs.ext4 program; empty means mkfs.ext4 from PATH (or
	// /usr/sbin, /sbin).
	Mkfs string
	// IgnoreOwners and SkipDevices let an import run without root (see
	// ociimage.Options). They are never turned on implicitly: an image
	// imported without its owners or devices differs from what its builder
	// made, so the operator asks for it.
	IgnoreOwners bool
	SkipDevices  bool
	// MaxBytes and MaxEntries are the import limits (config keys
	// image_import_max_bytes and image_import_max_entries); 0 means
	// ociimage's defaults.
	MaxBytes, MaxEntries int64
	// Logger receives import outcomes; nil discards them.
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Events gets image_ready and image_failed for each import that ends
	// (or that Recover finishes or fails); nil publishes none.
	Events events.Publisher
	// Committed, when set, is told the image id after an import committed
	// a new build, once the image's lock is released: the agent then
	// removes the builds nothing uses (Service.NewImporter). Without it
	// (`vmhost image import`) builds are only ever added.
	Committed func(id string)
}

// Importer imports images into a Catalog. Imports of one id are serialized
// across processes by a lock file, so the API's background imports and
// `vmhost image import` can share a state directory. An Importer is safe
// for concurrent use; Close cancels and waits for its background imports.
type Importer struct {
	cat Catalog
	o   ImportOptions

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// NewImporter returns an Importer writing into cat.
func NewImporter(cat Catalog, o ImportOptions) *Importer {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Importer{cat: cat, o: o, ctx: ctx, cancel: cancel}
}

// Catalog returns the catalog the Importer writes.
func (im *Importer) Catalog() Catalog { return im.cat }

// Wait waits until every background import has finished.
func (im *Importer) Wait() { im.wg.Wait() }

// Close cancels the background imports and waits for them; each records
// its cancellation as a failure.
func (im *Importer) Close() {
	im.cancel()
	im.wg.Wait()
}

// next is the staging dir of an import inside the image's directory: the
// new rootfs.qcow2 lands there, then image.json once the import is done.
// Its image.json is the commit point (see commit).
const nextDir = ".next"

// Start validates req, marks the image importing and imports it in the
// background. It returns the entry as it now reads: status importing for a
// first import, or the ready entry with reimport set. Errors: a bad id or
// path is a *vm.FieldError, an import of the id already running a
// *ConflictError.
func (im *Importer) Start(req *ImportRequest) (*Image, error) {
	lock, cur, err := im.begin(req)
	if err != nil {
		return nil, err
	}
	im.wg.Add(1)
	go func() {
		defer im.wg.Done()
		final, err := im.run(im.ctx, req, cur)
		lock.Close()
		if err != nil {
			im.o.Logger.Error("AppVM image import failed", "image", req.ID, "source", req.Path, "err", err)
			im.publish(events.ImageFailed, req.ID, err.Error())
			return
		}
		im.o.Logger.Info("AppVM image imported", "image", req.ID, "source", req.Path, "build_digest", final.BuildDigest)
		im.publish(events.ImageReady, req.ID, "")
		im.committed(req.ID)
	}()
	return cur, nil
}

func (im *Importer) committed(id string) {
	if im.o.Committed != nil {
		im.o.Committed(id)
	}
}

func (im *Importer) publish(t events.Type, id, msg string) {
	if im.o.Events != nil {
		im.o.Events.Publish(events.Event{Type: t, ImageID: id, Message: msg})
	}
}

// Import runs an import in the foreground, for `vmhost image import`, and
// returns the resulting entry. A failed import returns the error and
// leaves the entry failed (or, for a re-import, ready with reimport
// failed), as a background import would.
func (im *Importer) Import(ctx context.Context, req *ImportRequest) (*Image, error) {
	lock, cur, err := im.begin(req)
	if err != nil {
		return nil, err
	}
	final, err := im.run(ctx, req, cur)
	lock.Close()
	if err == nil {
		im.committed(req.ID)
	}
	return final, err
}

// begin validates req, takes the image's lock and records the import's
// start. The caller owns the lock on success.
func (im *Importer) begin(req *ImportRequest) (*os.File, *Image, error) {
	if !store.ValidID(req.ID) {
		return nil, nil, &vm.FieldError{Field: "id", Msg: "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"}
	}
	if !filepath.IsAbs(req.Path) {
		return nil, nil, &vm.FieldError{Field: "path", Msg: "must be an absolute host path"}
	}
	fi, err := os.Stat(req.Path)
	switch {
	case err != nil:
		return nil, nil, &vm.FieldError{Field: "path", Msg: fmt.Sprintf("cannot be read: %v", errors.Unwrap(err))}
	case !fi.IsDir() && !fi.Mode().IsRegular():
		return nil, nil, &vm.FieldError{Field: "path", Msg: "must be a directory (OCI layout) or a regular file (tar)"}
	}
	lock, err := im.lock(req.ID)
	if err != nil {
		return nil, nil, err
	}
	cur, err := im.cat.Get(req.ID)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		// A damaged entry is replaced by the new import.
		im.o.Logger.Warn("replacing unreadable AppVM image entry", "image", req.ID, "err", err)
		cur = nil
	}
	now := im.o.Now().UTC()
	var entry *Image
	if cur != nil && cur.Status == StatusReady {
		c := *cur
		c.Reimport = &Reimport{Status: StatusImporting, StartedAt: now, Source: req.Path}
		entry = &c
	} else {
		entry = &Image{ID: req.ID, Status: StatusImporting, CreatedAt: now, Source: req.Path}
	}
	dir := filepath.Join(im.cat.Dir, req.ID)
	err = os.RemoveAll(filepath.Join(dir, nextDir))
	if err == nil {
		err = im.cat.Put(entry)
	}
	if err != nil {
		lock.Close()
		return nil, nil, fmt.Errorf("starting import of AppVM image %q: %w", req.ID, err)
	}
	return lock, entry, nil
}

// run imports into the staging dir and commits, or records the failure.
// It holds the image's lock (taken by begin) throughout.
func (im *Importer) run(ctx context.Context, req *ImportRequest, cur *Image) (*Image, error) {
	dir := filepath.Join(im.cat.Dir, req.ID)
	staged := filepath.Join(dir, nextDir)
	res, err := ociimage.Import(ctx, req.Path, staged, ociimage.Options{
		Mkfs:         im.o.Mkfs,
		IgnoreOwners: im.o.IgnoreOwners,
		SkipDevices:  im.o.SkipDevices,
		MaxBytes:     im.o.MaxBytes,
		MaxEntries:   im.o.MaxEntries,
	})
	if err == nil {
		next := &Image{
			ID:        req.ID,
			Status:    StatusReady,
			CreatedAt: cur.CreatedAt,
			Source:    req.Path,
			Workload:  workload(res),
		}
		if cur.Reimport != nil {
			next.CreatedAt = cur.Reimport.StartedAt
		}
		err = writeImageJSON(staged, next)
		if err == nil {
			err = im.commit(dir)
		}
		if err == nil {
			return next, nil
		}
	}
	os.RemoveAll(staged)
	reason := err.Error()
	if errors.Is(err, context.Canceled) {
		reason = "import cancelled: the agent is shutting down"
		if cause := context.Cause(ctx); cause != nil && cause != context.Canceled { // a CLI import's signal
			reason = "import cancelled: " + cause.Error()
		}
	}
	failed := *cur
	if cur.Reimport != nil {
		r := *cur.Reimport
		r.Status, r.Failure = StatusFailed, reason
		failed.Reimport = &r
	} else {
		failed.Status, failed.Failure = StatusFailed, reason
	}
	if perr := im.cat.Put(&failed); perr != nil {
		return nil, errors.Join(err, perr)
	}
	return nil, fmt.Errorf("importing AppVM image %q: %w", req.ID, err)
}

// commit installs a finished staged import: the new build's root file
// system under its own name (rootfs-<digest>.qcow2), sealed (read-only
// and, where possible, immutable: overlays read through to it), then its
// image.json, then the staging dir goes. Because the staged image.json is
// written only after the staged rootfs is complete, Recover can finish a
// commit that a crash interrupted: a staged image.json means "roll
// forward".
//
// A build already there under the same digest (a re-import of the same
// image) is kept and the staged one dropped: AppVM overlays may read
// through to it, and a file made again is never byte-identical. No build
// is removed here: the agent removes those nothing uses (builds.go).
func (im *Importer) commit(dir string) error {
	staged := filepath.Join(dir, nextDir)
	data, err := os.ReadFile(filepath.Join(staged, "image.json"))
	if err != nil {
		return fmt.Errorf("installing the imported image: %w", err)
	}
	var next Image
	if err := json.Unmarshal(data, &next); err != nil {
		return fmt.Errorf("installing the imported image: %w", err)
	}
	build := filepath.Join(dir, buildName(next.BuildDigest))
	if _, err := os.Lstat(build); errors.Is(err, fs.ErrNotExist) {
		err = os.Rename(filepath.Join(staged, ociimage.RootfsName), build)
		if err != nil && !errors.Is(err, fs.ErrNotExist) { // gone: renamed before a crash
			return fmt.Errorf("installing the imported root file system: %w", err)
		}
	}
	seal, err := disk.SealBuild(build)
	if err != nil {
		return fmt.Errorf("installing the imported root file system: %w", err)
	}
	if seal.NotImmutable != nil {
		im.o.Logger.Info("AppVM image build sealed read-only, not immutable", "image", next.ID, "build", build, "why", seal.NotImmutable)
	}
	if err := os.Rename(filepath.Join(staged, "image.json"), filepath.Join(dir, "image.json")); err != nil {
		return fmt.Errorf("installing the imported image.json: %w", err)
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("installing the imported image: %w", err)
	}
	return os.RemoveAll(staged)
}

// sealBuilds seals every build of the image in dir, as commit does: the
// builds of images imported before builds were sealed (at agent start).
func (im *Importer) sealBuilds(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if e.Type().IsRegular() && isBuildName(e.Name()) {
			if _, err := disk.SealBuild(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// workload converts ociimage's result to the catalog's fields.
func workload(res *ociimage.Image) vm.Workload {
	w := vm.Workload{
		BuildDigest: res.BuildDigest,
		SizeBytes:   uint64(res.SizeBytes),
		Entrypoint:  res.Entrypoint,
		Cmd:         res.Cmd,
		Env:         res.Env,
		Workdir:     res.WorkingDir,
		User:        res.User,
	}
	if h := res.Healthcheck; h != nil {
		w.Healthcheck = &vm.Healthcheck{
			Test:            h.Test,
			IntervalSecs:    uint32(h.IntervalSecs),
			TimeoutSecs:     uint32(h.TimeoutSecs),
			StartPeriodSecs: uint32(h.StartPeriodSecs),
			Retries:         uint32(h.Retries),
		}
	}
	return w
}

// Recover cleans up after imports whose process ended early, as the agent
// does when it starts: for each image whose lock is free (no import
// running anywhere), a finished staged import is committed, unfinished work
// is removed, and an entry still marked importing becomes failed with
// InterruptedReason (a re-import's old build stays ready). Images being
// imported by another process are left alone.
func (im *Importer) Recover() error {
	ents, err := os.ReadDir(im.cat.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("recovering AppVM image imports: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), deletedPrefix) {
			if err := removeImageDir(filepath.Join(im.cat.Dir, e.Name())); err != nil {
				errs = append(errs, fmt.Errorf("removing a deleted AppVM image: %w", err))
			}
			continue
		}
		if !e.IsDir() || !store.ValidID(e.Name()) {
			continue
		}
		if err := im.recoverOne(e.Name()); err != nil && !errors.As(err, new(*ConflictError)) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func (im *Importer) recoverOne(id string) error {
	lock, err := im.lock(id)
	if err != nil {
		return err
	}
	defer lock.Close()
	dir := filepath.Join(im.cat.Dir, id)
	staged := filepath.Join(dir, nextDir)
	if _, err := os.Stat(filepath.Join(staged, "image.json")); err == nil {
		im.o.Logger.Info("finishing an interrupted AppVM image commit", "image", id)
		if err := im.commit(dir); err != nil {
			return fmt.Errorf("recovering AppVM image %q: %w", id, err)
		}
		im.publish(events.ImageReady, id, "")
		return nil
	}
	if err := os.RemoveAll(staged); err != nil {
		return fmt.Errorf("recovering AppVM image %q: %w", id, err)
	}
	if err := ociimage.RemoveStale(dir); err != nil {
		return fmt.Errorf("recovering AppVM image %q: %w", id, err)
	}
	if err := im.sealBuilds(dir); err != nil {
		return fmt.Errorf("recovering AppVM image %q: sealing its builds: %w", id, err)
	}
	cur, err := im.cat.Get(id)
	if err != nil {
		return fmt.Errorf("recovering AppVM image %q: %w", id, err)
	}
	switch {
	case cur.Status == StatusImporting:
		cur.Status, cur.Failure = StatusFailed, InterruptedReason
	case cur.Reimport != nil && cur.Reimport.Status == StatusImporting:
		cur.Reimport.Status, cur.Reimport.Failure = StatusFailed, InterruptedReason
	default:
		return nil
	}
	im.o.Logger.Warn("AppVM image import was interrupted", "image", id)
	if err := im.cat.Put(cur); err != nil {
		return err
	}
	im.publish(events.ImageFailed, id, InterruptedReason)
	return nil
}

// deletedPrefix names an image directory being deleted: it is renamed out
// of the catalog first, so a crash never leaves half an image under its id.
const deletedPrefix = ".deleted-"

// Delete removes image id from the catalog. users lists what uses an
// image; it is called with the image's lock held. Errors: unknown id →
// fs.ErrNotExist; an import running or anything using it →
// *ConflictError; users' error, wrapped.
func (im *Importer) Delete(id string, users func(id string) (ImageUsers, error)) error {
	if !store.ValidID(id) {
		return fmt.Errorf("AppVM image %q: %w", id, fs.ErrNotExist)
	}
	if _, err := im.cat.Get(id); err != nil && errors.Is(err, fs.ErrNotExist) {
		return err
	}
	lock, err := im.lock(id)
	if err != nil {
		return err
	}
	defer lock.Close()
	if _, err := im.cat.Get(id); errors.Is(err, fs.ErrNotExist) {
		return err // deleted meanwhile
	}
	u, err := users(id)
	if err != nil {
		return fmt.Errorf("deleting AppVM image %q: %w", id, err)
	}
	if msg := u.String(); msg != "" {
		return &ConflictError{Msg: fmt.Sprintf("AppVM image %q is used by %s; delete them first", id, msg)}
	}
	dir := filepath.Join(im.cat.Dir, id)
	gone, err := os.MkdirTemp(im.cat.Dir, deletedPrefix+id+"-")
	if err == nil {
		err = os.Rename(dir, filepath.Join(gone, id))
	}
	if err == nil {
		err = atomicfile.SyncDir(im.cat.Dir)
	}
	if err != nil {
		os.Remove(gone)
		return fmt.Errorf("deleting AppVM image %q: %w", id, err)
	}
	testStopAt(HookImageDeleteRenamed)
	// The lock file goes while it is held; lock() notices a removed file.
	os.Remove(lockPath(im.cat.Dir, id))
	if err := removeImageDir(gone); err != nil {
		return fmt.Errorf("deleting AppVM image %q: %w", id, err)
	}
	return nil
}

// ImageUsers are what keeps an image from being deleted: AppVMs (and
// creates in progress), and snapshots whose disks are overlays of its
// builds.
type ImageUsers struct{ AppVMs, Snapshots []string }

// String names the users, "" when there are none.
func (u ImageUsers) String() string {
	var parts []string
	for _, g := range []struct {
		what string
		ids  []string
	}{{"AppVMs", u.AppVMs}, {"snapshots", u.Snapshots}} {
		if len(g.ids) > 0 {
			ids := slices.Clone(g.ids)
			slices.Sort(ids)
			parts = append(parts, g.what+" "+strings.Join(ids, ", "))
		}
	}
	return strings.Join(parts, " and ")
}

func lockPath(dir, id string) string { return filepath.Join(dir, id+".lock") }

func (im *Importer) lock(id string) (*os.File, error) { return im.cat.lock(id) }

// lock takes the image's lock file without waiting; an import holding it
// (in this process or another) is a *ConflictError. The lock is released
// by closing the file.
func (c Catalog) lock(id string) (*os.File, error) {
	if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating AppVM image catalog: %w", err)
	}
	p := lockPath(c.Dir, id)
	for {
		f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, fmt.Errorf("locking AppVM image %q: %w", id, err)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, &ConflictError{Msg: fmt.Sprintf("an import of AppVM image %q is in progress", id)}
			}
			return nil, fmt.Errorf("locking AppVM image %q: %w", id, err)
		}
		// A Delete may have removed the file between our open and flock:
		// then we hold a lock nobody else can see; take the new file's.
		held, err1 := f.Stat()
		now, err2 := os.Stat(p)
		if err1 == nil && err2 == nil && os.SameFile(held, now) {
			return f, nil
		}
		f.Close()
	}
}
