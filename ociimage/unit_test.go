package ociimage

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name   string
		config string
		want   *Image
	}{
		{
			name:   "empty config",
			config: `{}`,
			want:   &Image{Entrypoint: []string{}, Cmd: []string{}, Env: []string{}},
		},
		{
			name:   "health check disabled",
			config: `{"os":"linux","architecture":"arm64","variant":"v8","config":{"Healthcheck":{"Test":["NONE"]}}}`,
			want: &Image{OS: "linux", Architecture: "arm64", Variant: "v8",
				Entrypoint: []string{}, Cmd: []string{}, Env: []string{},
				Healthcheck: &Healthcheck{Test: []string{"NONE"}}},
		},
		{
			name:   "empty health check test means none",
			config: `{"config":{"Healthcheck":{"Interval":1000000000}}}`,
			want:   &Image{Entrypoint: []string{}, Cmd: []string{}, Env: []string{}},
		},
		{
			name:   "sub-second durations round up",
			config: `{"config":{"Healthcheck":{"Test":["CMD","true"],"Interval":1,"Timeout":1000000001}}}`,
			want: &Image{Entrypoint: []string{}, Cmd: []string{}, Env: []string{},
				Healthcheck: &Healthcheck{Test: []string{"CMD", "true"}, IntervalSecs: 1, TimeoutSecs: 2}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _, err := parseConfig([]byte(tt.config))
			if err != nil {
				t.Fatalf("parseConfig: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("parseConfig(%s) =\n%+v\nwant\n%+v", tt.config, got, tt.want)
			}
		})
	}
	if (&Healthcheck{Test: []string{"NONE"}}).Disabled() != true || (&Healthcheck{Test: []string{"CMD", "x"}}).Disabled() || (*Healthcheck)(nil).Disabled() {
		t.Errorf("Healthcheck.Disabled is wrong")
	}
	if _, _, err := parseConfig([]byte(`{"config":[]}`)); !errors.Is(err, ErrInvalid) {
		t.Errorf("parseConfig of a malformed config = %v, want ErrInvalid", err)
	}
}

// memSource serves blobs from memory, for applying layers without an
// archive.
type memSource map[string][]byte

func (m memSource) open(name string) (io.ReadCloser, int64, error) {
	b, ok := m[name]
	if !ok {
		return nil, 0, fs.ErrNotExist
	}
	return io.NopCloser(bytes.NewReader(b)), int64(len(b)), nil
}
func (memSource) truncation() error { return nil }
func (memSource) Close() error      { return nil }

// FuzzApplyLayer applies arbitrary layer bytes and checks the one property
// that must hold for any input: nothing outside the staging root changes.
// The seeds are hostile layers; `go test -fuzz FuzzApplyLayer` explores
// further.
func FuzzApplyLayer(f *testing.F) {
	outsideRel := "../outside"
	f.Add(layerTar(f, fileEnt("../outside/x", "x", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", outsideRel), fileEnt("l/x", "x", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", "/"), fileEnt("l/x", "x", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", outsideRel), fileEnt("l/.wh.canary", "", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", outsideRel), fileEnt("l/.wh..wh..opq", "", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", outsideRel), hardlinkEnt("h", "l/canary")))
	f.Add(layerTar(f, dirEnt("a/", 0o755, 0, 0), symlinkEnt("a/b", "../../outside"), fileEnt("a/b/x", "x", 0o644, 0, 0)))
	f.Add(layerTar(f, symlinkEnt("l", outsideRel), dirEnt("l/", 0o755, 0, 0), fileEnt("l/x", "x", 0o644, 0, 0)))
	f.Add(gzipped(f, layerTar(f, fileEnt("ok", "fine", 0o644, 0, 0))))
	f.Fuzz(func(t *testing.T, layer []byte) {
		top := t.TempDir()
		rootfs := filepath.Join(top, "rootfs")
		outside := filepath.Join(top, "outside")
		for _, d := range []string{rootfs, outside} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		canary := filepath.Join(outside, "canary")
		if err := os.WriteFile(canary, []byte("canary"), 0o644); err != nil {
			t.Fatal(err)
		}
		d := digestOf(layer)
		src := memSource{"blobs/sha256/" + d[len("sha256:"):]: layer}
		applyLayers(context.Background(), src, []descriptor{{Digest: d, Size: int64(len(layer))}}, rootfs, Options{SkipDevices: true})
		ents, err := os.ReadDir(outside)
		if err != nil || len(ents) != 1 {
			t.Fatalf("outside dir changed: %v %v", ents, err)
		}
		if b, err := os.ReadFile(canary); err != nil || string(b) != "canary" || linkCount(t, canary) != 1 {
			t.Fatalf("canary changed: %q %v", b, err)
		}
		if ents, _ := os.ReadDir(top); len(ents) != 2 {
			t.Fatalf("something appeared next to the root: %v", ents)
		}
	})
}
