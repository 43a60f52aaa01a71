package seed

import (
	"bytes"
	"errors"
	"flag"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"vmhost/seed/fat"
	"vmhost/seed/internal/fatcheck"
)

var imageDir = flag.String("image-dir", "", "also copy each render case's seed image to DIR/<case>.img (for testdata/cloud-init-check.sh)")

func TestWriteFileEndToEnd(t *testing.T) {
	for _, tc := range renderCases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := Render(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "seed.img")
			n, err := WriteFile(path, f)
			if err != nil {
				t.Fatalf("WriteFile: %v", err)
			}
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if n != Size || fi.Size() != Size || fi.Mode().Perm() != 0o600 {
				t.Errorf("WriteFile = %d; file %d bytes, mode %v; want %d bytes, 0600", n, fi.Size(), fi.Mode(), Size)
			}

			img, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if *imageDir != "" {
				if err := os.WriteFile(filepath.Join(*imageDir, tc.name+".img"), img, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			back, err := ReadFiles(bytes.NewReader(img), int64(len(img)))
			if err != nil {
				t.Fatalf("ReadFiles: %v", err)
			}
			if !reflect.DeepEqual(back, f) {
				t.Errorf("ReadFiles = %+v, want %+v", back, f)
			}

			// Same config, same bytes.
			var buf bytes.Buffer
			if _, err := Write(&buf, f); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf.Bytes(), img) {
				t.Error("Write and WriteFile of the same documents differ")
			}

			want := []string{MetaDataName, UserDataName}
			if f.NetworkConfig != nil {
				want = append(want, NetworkConfigName)
			}
			fatcheck.Fsck(t, path)
			label, names := fatcheck.Mdir(t, path)
			if label != Label || !slices.Equal(names, want) {
				t.Errorf("mdir: label %q, names %q, want %q", label, names, want)
			}
			docs := map[string][]byte{MetaDataName: f.MetaData, UserDataName: f.UserData, NetworkConfigName: f.NetworkConfig}
			for _, name := range want {
				if got := fatcheck.Mtype(t, path, name); !bytes.Equal(got, docs[name]) {
					t.Errorf("mtype ::%s =\n%s\nwant\n%s", name, got, docs[name])
				}
			}
			kv := fatcheck.Blkid(t, path)
			if kv["TYPE"] != "vfat" || kv["LABEL"] != Label || kv["LABEL_FATBOOT"] != Label {
				t.Errorf("blkid: %v", kv)
			}
		})
	}
}

func TestVolumeIDFollowsInput(t *testing.T) {
	cfg := renderCases[0].cfg
	ids := map[uint32]string{}
	for _, iid := range []string{cfg.InstanceID, "iid-a", "iid-b"} {
		c := cfg
		c.InstanceID = iid
		f, err := Render(c)
		if err != nil {
			t.Fatal(err)
		}
		var a, b bytes.Buffer
		Write(&a, f)
		Write(&b, f)
		if !bytes.Equal(a.Bytes(), b.Bytes()) {
			t.Fatalf("instance-id %q: two writes differ", iid)
		}
		v, err := fat.Read(bytes.NewReader(a.Bytes()), Size)
		if err != nil {
			t.Fatal(err)
		}
		if prev, dup := ids[v.VolumeID]; dup {
			t.Errorf("instance-ids %q and %q share volume ID %08X", prev, iid, v.VolumeID)
		}
		ids[v.VolumeID] = iid
	}
}

func TestWriteFileRefusals(t *testing.T) {
	f, err := Render(renderCases[0].cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()

	// Not a regular file: a directory and a unix socket stay untouched.
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o755)
	if _, err := WriteFile(sub, f); err == nil {
		t.Error("WriteFile over a directory succeeded")
	}
	sock := filepath.Join(dir, "s.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := WriteFile(sock, f); err == nil {
		t.Error("WriteFile over a socket succeeded")
	}

	// Too big for the image: rejected, nothing left behind.
	big := f
	big.UserData = append([]byte("#cloud-config\n"), bytes.Repeat([]byte("# filler\n"), Size/9)...)
	target := filepath.Join(dir, "seed.img")
	if _, err := WriteFile(target, big); !errors.Is(err, fat.ErrNoSpace) {
		t.Errorf("WriteFile of %d bytes = %v, want fat.ErrNoSpace", len(big.UserData), err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.Contains(e.Name(), "seed.img") {
			t.Errorf("left %s behind", e.Name())
		}
	}

	// A replaced seed holds the new documents.
	if _, err := WriteFile(target, f); err != nil {
		t.Fatal(err)
	}
	f2 := f
	f2.MetaData = []byte("instance-id: \"other\"\n")
	if _, err := WriteFile(target, f2); err != nil {
		t.Fatal(err)
	}
	img, _ := os.ReadFile(target)
	back, err := ReadFiles(bytes.NewReader(img), int64(len(img)))
	if err != nil || !bytes.Equal(back.MetaData, f2.MetaData) {
		t.Errorf("after replace: %q, %v", back.MetaData, err)
	}
}

func TestReadFilesRejectsNonSeeds(t *testing.T) {
	for name, files := range map[string][]fat.File{
		"no user-data": {{Name: MetaDataName, Data: []byte("instance-id: x\n")}},
		"no meta-data": {{Name: UserDataName, Data: []byte("#cloud-config\n")}},
	} {
		img, err := fat.Build(files, fat.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ReadFiles(bytes.NewReader(img), int64(len(img))); !errors.Is(err, ErrNotSeed) {
			t.Errorf("%s: ReadFiles = %v, want ErrNotSeed", name, err)
		}
	}
	img, err := fat.Build([]fat.File{{Name: MetaDataName}, {Name: UserDataName}}, fat.Options{Label: "OTHER"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ReadFiles(bytes.NewReader(img), int64(len(img))); !errors.Is(err, ErrNotSeed) {
		t.Errorf("label OTHER: ReadFiles = %v, want ErrNotSeed", err)
	}
}

func TestImageWithOptions(t *testing.T) {
	f, err := Render(renderCases[0].cfg)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := Write(&buf, f); err != nil {
		t.Fatal(err)
	}
	img, err := Image(f, fat.Options{})
	if err != nil || !bytes.Equal(img, buf.Bytes()) {
		t.Errorf("Image with zero Options differs from Write (err %v)", err)
	}
	img, err = Image(f, fat.Options{VolumeID: 0x1234ABCD})
	if err != nil {
		t.Fatal(err)
	}
	v, err := fat.Read(bytes.NewReader(img), int64(len(img)))
	if err != nil || v.VolumeID != 0x1234ABCD || v.Label != Label {
		t.Errorf("Image with VolumeID: %+v, %v", v, err)
	}
}
