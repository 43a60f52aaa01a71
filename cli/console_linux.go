package cli

import (
	"io"
	"os"
)

// terminal puts in into raw mode when it is a terminal (what is typed goes
// to the guest byte by byte, ^C and ^Z included) and returns a function
// that restores it. Input that is not a terminal (a pipe) is used as is.
func terminal(in io.Reader) (io.Reader, func(), error) {
	f, ok := in.(*os.File)
	if !ok {
		return in, func() {}, nil
	}
	restore, _, err := rawTerminal(f)
	if err != nil {
		return nil, nil, err
	}
	return in, restore, nil
}
