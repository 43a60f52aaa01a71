package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
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

// FuzzApplyLayer applies arbitrary layers and checks the one property
// that must hold for any input: nothing outside the staging root changes.
// The input is a layer spelled as text, one entry per line (see
// specLayer), so seeds stay a few bytes long and `go test -fuzz
// FuzzApplyLayer` spends its time exploring entry sequences rather than
// minimizing kilobytes of tar padding. The seeds are hostile layers.
func FuzzApplyLayer(f *testing.F) {
	for _, seed := range []string{
		"F ../outside/x x",
		"L l ../outside\nF l/x x",
		"L l /\nF l/x x",
		"L l ../outside\nF l/.wh.canary",
		"L l ../outside\nF l/.wh..wh..opq",
		"L l ../outside\nH h l/canary",
		"D a\nL a/b ../../outside\nF a/b/x x",
		"L l ../outside\nD l\nF l/x x",
		"D a\nF a/f x\nH a/g a/f\nF a/.wh..wh..opq\nP a/p",
		"gz\nF ok fine",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		layer := specLayer(t, spec)
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
		applyLayers(context.Background(), src, []descriptor{{Digest: d, Size: int64(len(layer)), DiffID: d}}, rootfs, Options{SkipDevices: true})
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

// specLayer builds a layer tar from lines "TYPE NAME [ARG]": F a file
// (ARG its content), D a directory, L a symlink to ARG, H a hard link to
// ARG, P a fifo. A first line "gz" gzips the layer. Other lines are
// skipped.
func specLayer(t testing.TB, spec string) []byte {
	lines := strings.Split(spec, "\n")
	gz := len(lines) > 0 && lines[0] == "gz"
	var ents []ent
	for _, line := range lines {
		typ, rest, _ := strings.Cut(line, " ")
		name, arg, _ := strings.Cut(rest, " ")
		if name == "" {
			continue
		}
		switch typ {
		case "F":
			ents = append(ents, fileEnt(name, arg, 0o644, 0, 0))
		case "D":
			ents = append(ents, dirEnt(name, 0o755, 0, 0))
		case "L":
			ents = append(ents, symlinkEnt(name, arg))
		case "H":
			ents = append(ents, hardlinkEnt(name, arg))
		case "P":
			ents = append(ents, ent{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: name, Mode: 0o644}})
		}
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := e.hdr
		h.ModTime = testTime
		if tw.WriteHeader(&h) != nil { // a name tar cannot hold
			continue
		}
		io.WriteString(tw, e.body)
	}
	tw.Close()
	if gz {
		return gzipped(t, buf.Bytes())
	}
	return buf.Bytes()
}
