package cli

import (
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// terminal puts in into raw mode when it is a terminal (what is typed goes
// to the guest byte by byte, ^C and ^Z included) and returns a function
// that restores it. Input that is not a terminal (a pipe) is used as is.
func terminal(in io.Reader) (io.Reader, func(), error) {
	f, ok := in.(*os.File)
	if !ok {
		return in, func() {}, nil
	}
	fd := int(f.Fd())
	saved, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return in, func() {}, nil // not a terminal
	}
	raw := *saved
	// cfmakeraw(3).
	raw.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	raw.Oflag &^= unix.OPOST
	raw.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	raw.Cflag &^= unix.CSIZE | unix.PARENB
	raw.Cflag |= unix.CS8
	raw.Cc[unix.VMIN] = 1
	raw.Cc[unix.VTIME] = 0
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, &raw); err != nil {
		return nil, nil, err
	}
	return in, func() { unix.IoctlSetTermios(fd, unix.TCSETS, saved) }, nil
}
