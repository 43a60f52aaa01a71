package seed

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"vmhost/internal/atomicfile"
	"vmhost/seed/fat"
)

// Size is the seed image's size in bytes (1 MiB, the layout the reference
// recommends); the VM view reports it as seed_disk.size_bytes.
const Size = fat.DefaultSize

// Label is the seed's volume label, in the boot sector and the root
// directory, as cloud-init's NoCloud datasource looks for it.
const Label = fat.DefaultLabel

// ErrNotSeed reports an image without meta-data or user-data, which NoCloud
// would not accept as a seed.
var ErrNotSeed = errors.New("not a NoCloud seed")

// fatFiles lists the documents in the order they are stored.
func (f Files) fatFiles() []fat.File {
	files := []fat.File{{Name: MetaDataName, Data: f.MetaData}, {Name: UserDataName, Data: f.UserData}}
	if f.NetworkConfig != nil {
		files = append(files, fat.File{Name: NetworkConfigName, Data: f.NetworkConfig})
	}
	return files
}

// Image returns the seed image bytes for f, built with opts; the zero
// Options give what Write writes. Documents that do not fit are an error
// wrapping fat.ErrNoSpace.
func Image(f Files, opts fat.Options) ([]byte, error) {
	if opts.Label == "" {
		opts.Label = Label
	}
	img, err := fat.Build(f.fatFiles(), opts)
	if err != nil {
		return nil, fmt.Errorf("building seed image: %w", err)
	}
	return img, nil
}

// Write writes the Size-byte seed image for f to w and returns the number
// of bytes written.
func Write(w io.Writer, f Files) (int64, error) {
	n, err := fat.Write(w, f.fatFiles(), fat.Options{Label: Label})
	if err != nil {
		return n, fmt.Errorf("writing seed image: %w", err)
	}
	return n, nil
}

// WriteFile writes the seed image for f to path, replacing any file there
// atomically: a temporary file in the same directory is written, synced
// and renamed over path, and the directory is synced. The file is sparse
// (only the used part is written; the rest reads as zeros) and 0600,
// because user-data may hold a clear-text password. It returns the image
// size (Size). Documents that do not fit give an error wrapping
// fat.ErrNoSpace and leave path untouched.
func WriteFile(path string, f Files) (int64, error) {
	var n int64
	err := atomicfile.Fill(path, 0o600, func(tmp *os.File) error {
		var err error
		n, err = fat.WriteSparse(tmp, f.fatFiles(), fat.Options{Label: Label})
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("writing seed image %s: %w", path, err)
	}
	return n, nil
}

// ReadFiles reads the documents back from a seed image of size bytes. It
// fails with ErrNotSeed when meta-data or user-data is missing or the
// label is not Label, and with an error wrapping fat.ErrCorrupt for a
// damaged image. NetworkConfig is nil when the image has none.
func ReadFiles(r io.ReaderAt, size int64) (Files, error) {
	v, err := fat.Read(r, size)
	if err != nil {
		return Files{}, fmt.Errorf("reading seed image: %w", err)
	}
	if v.Label != Label || v.BootLabel != Label {
		return Files{}, fmt.Errorf("%w: labels %q and %q, want %q", ErrNotSeed, v.Label, v.BootLabel, Label)
	}
	var f Files
	for _, file := range v.Files {
		data := bytes.Clone(file.Data)
		if data == nil {
			data = []byte{}
		}
		switch file.Name {
		case MetaDataName:
			f.MetaData = data
		case UserDataName:
			f.UserData = data
		case NetworkConfigName:
			f.NetworkConfig = data
		}
	}
	if f.MetaData == nil || f.UserData == nil {
		return Files{}, fmt.Errorf("%w: meta-data or user-data missing", ErrNotSeed)
	}
	return f, nil
}
