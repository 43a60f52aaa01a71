//go:build !linux

package cli

import (
	"errors"
	"io"
)

// terminal refuses: the console is attached on the agent's host, which is
// Linux.
func terminal(in io.Reader) (io.Reader, func(), error) {
	return nil, nil, errors.New("vmhost console works on the agent's (Linux) host only")
}
