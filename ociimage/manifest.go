package ociimage

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"
	"time"
)

// Media types this package tells apart; layer media types are not
// inspected, their bytes are.
const (
	mediaOCIIndex       = "application/vnd.oci.image.index.v1+json"
	mediaOCIManifest    = "application/vnd.oci.image.manifest.v1+json"
	mediaDockerList     = "application/vnd.docker.distribution.manifest.list.v2+json"
	mediaDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
)

// Annotations that name an image in an index.
const (
	annotRefName        = "org.opencontainers.image.ref.name"
	annotContainerdName = "io.containerd.image.name"
	annotDockerRefType  = "vnd.docker.reference.type"
)

// Limits on the small JSON documents, against a hostile archive.
const (
	maxIndexBytes  = 4 << 20
	maxConfigBytes = 16 << 20
	maxIndexDepth  = 4
)

// resolved is what the manifest says to import.
type resolved struct {
	buildDigest string
	config      descriptor
	layers      []descriptor
}

type platform struct {
	OS           string `json:"os"`
	Architecture string `json:"architecture"`
	Variant      string `json:"variant"`
}

func (p *platform) String() string {
	if p == nil {
		return "unknown"
	}
	s := p.OS + "/" + p.Architecture
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

type indexEntry struct {
	descriptor
	Platform    *platform         `json:"platform"`
	Annotations map[string]string `json:"annotations"`
}

type ociIndex struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []indexEntry `json:"manifests"`
}

type ociManifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

type dockerManifestEntry struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

// resolve finds the manifest to import: OCI index.json first, docker
// manifest.json otherwise.
func resolve(src source, opts Options) (*resolved, error) {
	data, err := readFile(src, "index.json", maxIndexBytes)
	if err == nil {
		var idx ociIndex
		if err := json.Unmarshal(data, &idx); err != nil {
			return nil, fmt.Errorf("%w: index.json: %v", ErrInvalid, err)
		}
		return resolveIndex(src, &idx, opts, 0)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	data, err = readFile(src, "manifest.json", maxIndexBytes)
	if err == nil {
		return resolveDocker(src, data, opts)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if trunc := src.truncation(); trunc != nil {
		return nil, fmt.Errorf("neither index.json nor manifest.json in the archive: %w", trunc)
	}
	return nil, fmt.Errorf("%w: neither index.json (OCI image layout) nor manifest.json (docker save) found", ErrInvalid)
}

func refNames(e *indexEntry) []string {
	var names []string
	for _, k := range []string{annotRefName, annotContainerdName} {
		if v := e.Annotations[k]; v != "" {
			names = append(names, v)
		}
	}
	return names
}

// pickManifest chooses one entry of an index by ref, then by platform.
func pickManifest(entries []indexEntry, opts Options) (*indexEntry, error) {
	var cands []*indexEntry
	for i := range entries {
		e := &entries[i]
		if e.Annotations[annotDockerRefType] == "attestation-manifest" ||
			e.Platform != nil && e.Platform.OS == "unknown" {
			continue
		}
		cands = append(cands, e)
	}
	if opts.Ref != "" {
		var byRef []*indexEntry
		var all []string
		for _, e := range cands {
			names := refNames(e)
			all = append(all, names...)
			if slices.Contains(names, opts.Ref) {
				byRef = append(byRef, e)
			}
		}
		// An index below the top level has no names: its entries differ
		// by platform only.
		if len(byRef) > 0 || len(all) > 0 {
			if len(byRef) == 0 {
				return nil, fmt.Errorf("%w: no image named %q in the index (have %s)", ErrInvalid, opts.Ref, strings.Join(all, ", "))
			}
			cands = byRef
		}
	}
	if len(cands) == 1 {
		return cands[0], nil
	}
	if len(cands) == 0 {
		return nil, fmt.Errorf("%w: the index lists no image manifest", ErrInvalid)
	}
	var byPlatform []*indexEntry
	var have []string
	for _, e := range cands {
		have = append(have, e.Platform.String())
		if e.Platform != nil && platformMatches(e.Platform, opts.Platform) {
			byPlatform = append(byPlatform, e)
		}
	}
	switch {
	case len(byPlatform) == 1:
		return byPlatform[0], nil
	case len(byPlatform) == 0 && slices.ContainsFunc(cands, func(e *indexEntry) bool { return e.Platform != nil }):
		return nil, fmt.Errorf("%w: no manifest for platform %s in the index (have %s)", ErrInvalid, opts.Platform, strings.Join(have, ", "))
	case len(byPlatform) == 0:
		byPlatform = cands // several images that do not say their platform
	}
	var names []string
	for _, e := range byPlatform {
		names = append(names, refNames(e)...)
	}
	return nil, fmt.Errorf("%w: the index holds %d images for %s; choose one by name (%s)", ErrInvalid, len(byPlatform), opts.Platform, strings.Join(names, ", "))
}

// platformMatches compares p with "os/arch[/variant]"; a missing variant
// on either side matches any.
func platformMatches(p *platform, want string) bool {
	parts := strings.SplitN(want, "/", 3)
	if len(parts) < 2 || p.OS != parts[0] || p.Architecture != parts[1] {
		return false
	}
	return len(parts) < 3 || p.Variant == "" || p.Variant == parts[2]
}

func resolveIndex(src source, idx *ociIndex, opts Options, depth int) (*resolved, error) {
	if depth > maxIndexDepth {
		return nil, fmt.Errorf("%w: indexes nested more than %d deep", ErrInvalid, maxIndexDepth)
	}
	e, err := pickManifest(idx.Manifests, opts)
	if err != nil {
		return nil, err
	}
	what := "manifest " + e.Digest
	data, err := readBlob(src, e.descriptor, "manifest", maxIndexBytes)
	if err != nil {
		return nil, err
	}
	switch e.MediaType {
	case mediaOCIIndex, mediaDockerList:
		var sub ociIndex
		if err := json.Unmarshal(data, &sub); err != nil {
			return nil, fmt.Errorf("%w: index %s: %v", ErrInvalid, e.Digest, err)
		}
		return resolveIndex(src, &sub, opts, depth+1)
	case mediaOCIManifest, mediaDockerManifest, "":
	default:
		return nil, fmt.Errorf("%w: %s has media type %q, not an image manifest", ErrInvalid, what, e.MediaType)
	}
	var m ociManifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalid, what, err)
	}
	if e.MediaType == "" && m.MediaType == mediaOCIIndex {
		var sub ociIndex
		if err := json.Unmarshal(data, &sub); err != nil {
			return nil, fmt.Errorf("%w: index %s: %v", ErrInvalid, e.Digest, err)
		}
		return resolveIndex(src, &sub, opts, depth+1)
	}
	if m.Config.Digest == "" {
		return nil, fmt.Errorf("%w: %s names no config", ErrInvalid, what)
	}
	for i, l := range m.Layers {
		if l.Digest == "" {
			return nil, fmt.Errorf("%w: %s: layer %d has no digest", ErrInvalid, what, i+1)
		}
	}
	return &resolved{buildDigest: e.Digest, config: m.Config, layers: m.Layers}, nil
}

// digestFromPath returns "sha256:<hex>" for blobs/sha256/<hex> and
// <hex>.json paths, which docker save uses, or "" for others.
func digestFromPath(p string) string {
	p = cleanArchiveName(p)
	name := path.Base(p)
	if strings.HasPrefix(p, "blobs/sha256/") && path.Dir(p) == "blobs/sha256" {
		if d := "sha256:" + name; validDigest(d) {
			return d
		}
	}
	if hexPart, ok := strings.CutSuffix(name, ".json"); ok && path.Dir(p) == "." {
		if d := "sha256:" + hexPart; validDigest(d) {
			return d
		}
	}
	return ""
}

func resolveDocker(src source, data []byte, opts Options) (*resolved, error) {
	var entries []dockerManifestEntry
	if err := json.Unmarshal(data, &entries); err != nil {
		return nil, fmt.Errorf("%w: manifest.json: %v", ErrInvalid, err)
	}
	var pick *dockerManifestEntry
	switch {
	case opts.Ref != "":
		var all []string
		for i := range entries {
			all = append(all, entries[i].RepoTags...)
			if slices.Contains(entries[i].RepoTags, opts.Ref) {
				pick = &entries[i]
				break
			}
		}
		if pick == nil {
			return nil, fmt.Errorf("%w: no image tagged %q in manifest.json (have %s)", ErrInvalid, opts.Ref, strings.Join(all, ", "))
		}
	case len(entries) == 1:
		pick = &entries[0]
	case len(entries) == 0:
		return nil, fmt.Errorf("%w: manifest.json lists no image", ErrInvalid)
	default:
		var all []string
		for i := range entries {
			all = append(all, entries[i].RepoTags...)
		}
		return nil, fmt.Errorf("%w: manifest.json holds %d images; choose one by tag (%s)", ErrInvalid, len(entries), strings.Join(all, ", "))
	}
	if pick.Config == "" {
		return nil, fmt.Errorf("%w: manifest.json names no Config", ErrInvalid)
	}
	res := &resolved{config: descriptor{Path: pick.Config, Digest: digestFromPath(pick.Config), Size: -1}}
	if res.config.Digest == "" {
		// No digest to check the config against; name the build by what
		// the config holds.
		cfg, err := readFile(src, pick.Config, maxConfigBytes)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("blob %s (config) %w", pick.Config, ErrMissingBlob)
			}
			return nil, err
		}
		sum := sha256.Sum256(cfg)
		res.config.Digest = "sha256:" + hex.EncodeToString(sum[:])
	}
	res.buildDigest = res.config.Digest
	for _, l := range pick.Layers {
		// A layer without a digest in its path gets its diff_id later.
		res.layers = append(res.layers, descriptor{Path: l, Digest: digestFromPath(l), Size: -1})
	}
	return res, nil
}

type imageConfig struct {
	Created      string `json:"created"`
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
	Variant      string `json:"variant"`
	Config       struct {
		User        string            `json:"User"`
		Env         []string          `json:"Env"`
		Entrypoint  []string          `json:"Entrypoint"`
		Cmd         []string          `json:"Cmd"`
		WorkingDir  string            `json:"WorkingDir"`
		Labels      map[string]string `json:"Labels"`
		StopSignal  string            `json:"StopSignal"`
		Healthcheck *struct {
			Test        []string `json:"Test"`
			Interval    int64    `json:"Interval"`
			Timeout     int64    `json:"Timeout"`
			StartPeriod int64    `json:"StartPeriod"`
			Retries     int      `json:"Retries"`
		} `json:"Healthcheck"`
	} `json:"config"`
	RootFS struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

// ceilSecs turns Go nanoseconds into whole seconds, rounding up so that a
// sub-second setting does not become "default".
func ceilSecs(ns int64) int {
	if ns <= 0 {
		return 0
	}
	return int((ns + int64(time.Second) - 1) / int64(time.Second))
}

// parseConfig reads the workload defaults of an image config and its
// diff_ids.
func parseConfig(data []byte) (*Image, []string, error) {
	var c imageConfig
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, nil, fmt.Errorf("%w: image config: %v", ErrInvalid, err)
	}
	img := &Image{
		OS:           c.OS,
		Architecture: c.Architecture,
		Variant:      c.Variant,
		Entrypoint:   nonNil(c.Config.Entrypoint),
		Cmd:          nonNil(c.Config.Cmd),
		Env:          nonNil(c.Config.Env),
		WorkingDir:   c.Config.WorkingDir,
		User:         c.Config.User,
		StopSignal:   c.Config.StopSignal,
		Labels:       c.Config.Labels,
	}
	if t, err := time.Parse(time.RFC3339Nano, c.Created); err == nil {
		img.Created = t.UTC()
	}
	if hc := c.Config.Healthcheck; hc != nil && len(hc.Test) > 0 {
		img.Healthcheck = &Healthcheck{
			Test:            hc.Test,
			IntervalSecs:    ceilSecs(hc.Interval),
			TimeoutSecs:     ceilSecs(hc.Timeout),
			StartPeriodSecs: ceilSecs(hc.StartPeriod),
			Retries:         hc.Retries,
		}
	}
	return img, c.RootFS.DiffIDs, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
