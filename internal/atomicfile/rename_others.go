//go:build !linux

package atomicfile

import "os"

// renameNoReplace moves tmp to name inside root without replacing a file
// that appeared at name meanwhile (fs.ErrExist then), through a hard link.
func renameNoReplace(root *os.Root, _ *os.File, tmp, name string) error {
	return linkNoReplace(root, tmp, name)
}
