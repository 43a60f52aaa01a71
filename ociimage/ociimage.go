package ociimage

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
	"vmhost/internal/sbin"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// Sentinel errors that Import's errors match with errors.Is. The error text
// adds which blob, layer or path was at fault.
var (
	// ErrDigestMismatch: a blob's content does not hash to its digest, or
	// its size differs from its descriptor.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrMissingBlob: a blob the manifest names is not in the source. It
	// also matches fs.ErrNotExist.
	ErrMissingBlob = missingBlobError{}
	// ErrTruncated: the archive or a blob ends early.
	ErrTruncated = errors.New("truncated archive")
	// ErrUnsafePath: a layer entry would be written outside the image root.
	ErrUnsafePath = errors.New("escapes the image root")
	// ErrUnsupported: valid input this importer does not handle, such as
	// zstd-compressed layers.
	ErrUnsupported = errors.New("not supported")
	// ErrInvalid: the source is not an image this package understands, or
	// its manifest or config is malformed.
	ErrInvalid = errors.New("invalid image")
	// ErrLimit: the image passes one of the import limits (Options.MaxBytes,
	// Options.MaxEntries, MaxPathDepth, MaxPathBytes); the error names it.
	ErrLimit = errors.New("over an import limit")
)

// Import limits. The defaults of Options.MaxBytes and MaxEntries are those
// of the config keys image_import_max_bytes and image_import_max_entries.
const (
	DefaultMaxBytes   = 16 << 30
	DefaultMaxEntries = 1_000_000
	// MaxPathDepth and MaxPathBytes bound every path of the unpacked tree
	// (mkfs.ext4 -d aborts on trees much deeper).
	MaxPathDepth = 256
	MaxPathBytes = 4096
)

type missingBlobError struct{}

func (missingBlobError) Error() string        { return "missing from archive" }
func (missingBlobError) Is(target error) bool { return target == fs.ErrNotExist }

// RootfsName is the file name of the imported root disk inside dstDir.
const RootfsName = "rootfs.qcow2"

// Options tune Import. The zero value is ready to use.
type Options struct {
	// Ref selects the image by name when the source holds several: it is
	// matched against the org.opencontainers.image.ref.name and
	// io.containerd.image.name annotations of an OCI index and against
	// RepoTags of a docker manifest.json. Empty: choose by Platform.
	Ref string
	// Platform is "os/arch" or "os/arch/variant" to pick from a
	// multi-platform index. Empty means "linux/" + runtime.GOARCH.
	Platform string
	// IgnoreOwners leaves files owned by the importing user when it may not
	// chown; without it such an import fails.
	IgnoreOwners bool
	// SkipDevices leaves out character and block devices that the importing
	// user may not create; without it such an import fails.
	SkipDevices bool
	// Mkfs is the mkfs.ext4 program; empty means mkfs.ext4 from PATH, or
	// /usr/sbin or /sbin (package sbin).
	Mkfs string
	// MaxBytes caps the unpacked content: the uncompressed layer streams
	// of all layers together, and a gzip-compressed source archive once
	// decompressed. The import fails as soon as it is passed. 0 means
	// DefaultMaxBytes.
	MaxBytes int64
	// MaxEntries caps the entries of all layers together, and those of
	// the source archive. 0 means DefaultMaxEntries.
	MaxEntries int64
}

func (o *Options) setDefaults() {
	if o.Platform == "" {
		o.Platform = "linux/" + runtime.GOARCH
	}
	if o.Mkfs == "" {
		o.Mkfs = sbin.Path("mkfs.ext4")
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
}

// Image describes an imported image. Its JSON names are those of the AppVM
// image catalog.
type Image struct {
	// BuildDigest identifies the build: the manifest digest ("sha256:…"),
	// or for a docker save tarball without one, the config digest.
	BuildDigest string `json:"build_digest"`
	// ConfigDigest is the digest of the image config blob.
	ConfigDigest string `json:"config_digest"`
	// RootfsPath is dstDir/rootfs.qcow2.
	RootfsPath string `json:"-"`
	// SizeBytes is the virtual size of the root disk.
	SizeBytes int64 `json:"size_bytes"`
	// Created is the build time the config states; zero when absent.
	Created time.Time `json:"image_created,omitzero"`
	// OS, Architecture and Variant come from the config.
	OS           string `json:"os,omitempty"`
	Architecture string `json:"architecture,omitempty"`
	Variant      string `json:"variant,omitempty"`

	// Workload defaults from the config.
	Entrypoint  []string          `json:"entrypoint"`
	Cmd         []string          `json:"cmd"`
	Env         []string          `json:"env"`
	WorkingDir  string            `json:"workdir"`
	User        string            `json:"user"`
	Healthcheck *Healthcheck      `json:"healthcheck,omitempty"`
	StopSignal  string            `json:"stop_signal,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`

	// Layers is how many layers were applied.
	Layers int `json:"-"`
	// SkippedDevices counts device nodes left out under
	// Options.SkipDevices.
	SkippedDevices int `json:"-"`
}

// Healthcheck is the image's health check (Docker's HEALTHCHECK). Zero
// durations and Retries mean "the runtime's default". Durations are whole
// seconds, rounded up.
type Healthcheck struct {
	// Test is ["CMD", args...], ["CMD-SHELL", command] or ["NONE"].
	Test            []string `json:"test"`
	IntervalSecs    int      `json:"interval_secs,omitempty"`
	TimeoutSecs     int      `json:"timeout_secs,omitempty"`
	StartPeriodSecs int      `json:"start_period_secs,omitempty"`
	Retries         int      `json:"retries,omitempty"`
}

// Disabled reports whether the image explicitly turns health checks off
// (HEALTHCHECK NONE).
func (h *Healthcheck) Disabled() bool {
	return h != nil && len(h.Test) > 0 && h.Test[0] == "NONE"
}

// Import reads the image at src (an OCI layout directory or tar, or a
// docker save tar) and writes its root file system to dstDir/rootfs.qcow2,
// replacing an existing one by rename. dstDir is created (0755) when
// missing. Work happens in a temp dir .import-* inside dstDir, which is
// removed in the end; on failure so is dstDir if Import created it, so a
// failed import leaves nothing behind (after a crash, RemoveStale cleans
// up). The temp dir needs room for about twice the unpacked image. Cancelling ctx stops the import.
// Import is safe to call concurrently for different dstDirs.
func Import(ctx context.Context, src string, dstDir string, opts Options) (img *Image, err error) {
	opts.setDefaults()
	createdDst := false
	if _, statErr := os.Stat(dstDir); errors.Is(statErr, fs.ErrNotExist) {
		if err := os.MkdirAll(dstDir, 0o755); err != nil {
			return nil, fmt.Errorf("creating image dir: %w", err)
		}
		createdDst = true
	}
	tmp, err := os.MkdirTemp(dstDir, tempPrefix)
	if err != nil {
		return nil, fmt.Errorf("creating import temp dir: %w", err)
	}
	defer func() {
		if rmErr := os.RemoveAll(tmp); rmErr != nil && err == nil {
			err = fmt.Errorf("removing import temp dir: %w", rmErr)
		}
		if err != nil && createdDst {
			os.Remove(dstDir) // only if still empty
		}
		if err != nil {
			img = nil
		}
	}()

	source, err := openSource(ctx, src, tmp, opts)
	if err != nil {
		return nil, err
	}
	defer source.Close()

	res, err := resolve(source, opts)
	if err != nil {
		return nil, err
	}
	cfgData, err := readBlob(source, res.config, "config", maxConfigBytes)
	if err != nil {
		return nil, err
	}
	img, diffIDs, err := parseConfig(cfgData)
	if err != nil {
		return nil, err
	}
	img.BuildDigest = res.buildDigest
	img.ConfigDigest = res.config.Digest
	// Each layer's uncompressed stream is verified against its diff_id.
	// Legacy docker save layers have no digest of their own: their
	// diff_ids are the digests of the (uncompressed) layer.tar files.
	if len(diffIDs) != len(res.layers) {
		return nil, fmt.Errorf("%w: config has %d diff_ids for %d layers", ErrInvalid, len(diffIDs), len(res.layers))
	}
	for i := range res.layers {
		if !validDigest(diffIDs[i]) {
			return nil, fmt.Errorf("%w: config diff_id %d %q is not a sha256 digest", ErrInvalid, i+1, diffIDs[i])
		}
		res.layers[i].DiffID = diffIDs[i]
		if res.layers[i].Digest == "" {
			res.layers[i].Digest = diffIDs[i]
		}
	}

	rootfs := filepath.Join(tmp, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return nil, fmt.Errorf("creating staging rootfs: %w", err)
	}
	skipped, err := applyLayers(ctx, source, res.layers, rootfs, opts)
	if err != nil {
		return nil, err
	}
	img.Layers = len(res.layers)
	img.SkippedDevices = skipped

	raw := filepath.Join(tmp, "rootfs.ext4")
	size, err := makeExt4(ctx, opts.Mkfs, rootfs, raw)
	if err != nil {
		return nil, err
	}
	// The staging tree is no longer needed; free its space before the
	// qcow2 copy needs some.
	if err := os.RemoveAll(rootfs); err != nil {
		return nil, fmt.Errorf("removing staging rootfs: %w", err)
	}
	qc := filepath.Join(tmp, RootfsName)
	if err := convertToQcow2(qc, raw); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil { // the conversion does not watch ctx
		return nil, err
	}
	dst := filepath.Join(dstDir, RootfsName)
	// ConvertRaw made qc durable; Rename installs it over dst and syncs
	// dstDir.
	if err := atomicfile.Rename(qc, dst); err != nil {
		return nil, fmt.Errorf("installing %s: %w", RootfsName, err)
	}
	img.RootfsPath = dst
	img.SizeBytes = size
	return img, nil
}

// checkPathLimits refuses a path (relative to the image root) that is
// longer than MaxPathBytes or deeper than MaxPathDepth.
func checkPathLimits(name string) error {
	if len(name) > MaxPathBytes {
		return fmt.Errorf("%w: path %q is %d bytes long, more than %d", ErrLimit, shortPath(name), len(name), MaxPathBytes)
	}
	if depth := strings.Count(name, "/") + 1; depth > MaxPathDepth {
		return fmt.Errorf("%w: path %q is %d components deep, more than %d", ErrLimit, shortPath(name), depth, MaxPathDepth)
	}
	return nil
}

// shortPath shortens a long path for an error message.
func shortPath(name string) string {
	if len(name) <= 64 {
		return name
	}
	return name[:64] + "..."
}

// tempPrefix starts the name of Import's temp dir inside dstDir.
const tempPrefix = ".import-"

// RemoveStale removes the temp dirs that imports interrupted by a crash or
// power loss left in dstDir; a missing dstDir is fine. Call it only while
// no Import into dstDir runs, such as when the agent starts.
func RemoveStale(dstDir string) error {
	ents, err := os.ReadDir(dstDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("removing stale imports: %w", err)
	}
	var errs []error
	for _, e := range ents {
		if e.IsDir() && strings.HasPrefix(e.Name(), tempPrefix) {
			if err := os.RemoveAll(filepath.Join(dstDir, e.Name())); err != nil {
				errs = append(errs, fmt.Errorf("removing stale import: %w", err))
			}
		}
	}
	return errors.Join(errs...)
}

// convertToQcow2 writes the raw image at rawPath as qcow2 at dst.
func convertToQcow2(dst, rawPath string) error {
	f, err := os.Open(rawPath)
	if err != nil {
		return fmt.Errorf("converting root file system to qcow2: %w", err)
	}
	defer f.Close()
	if err := qcow2.ConvertRaw(dst, f); err != nil {
		return fmt.Errorf("converting root file system to qcow2: %w", err)
	}
	return nil
}
