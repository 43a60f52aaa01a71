//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly

package cli

import (
	"os"
	"os/signal"

	"golang.org/x/sys/unix"
)

// rawTerminal puts the terminal f into raw mode (cfmakeraw(3): what is
// typed goes through byte by byte, ^C and ^Z included, and output is not
// post-processed) and returns a function that restores it; ok is false,
// and nothing changed, when f is no terminal.
func rawTerminal(f *os.File) (restore func(), ok bool, err error) {
	fd := int(f.Fd())
	saved, err := unix.IoctlGetTermios(fd, ioctlGetTermios)
	if err != nil {
		return func() {}, false, nil // not a terminal
	}
	raw := *saved
	raw.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	raw.Oflag &^= unix.OPOST
	raw.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	raw.Cflag &^= unix.CSIZE | unix.PARENB
	raw.Cflag |= unix.CS8
	raw.Cc[unix.VMIN] = 1
	raw.Cc[unix.VTIME] = 0
	if err := unix.IoctlSetTermios(fd, ioctlSetTermios, &raw); err != nil {
		return nil, false, err
	}
	return func() { unix.IoctlSetTermios(fd, ioctlSetTermios, saved) }, true, nil
}

// terminalSize returns the size of the terminal f; ok is false when f is
// no terminal.
func terminalSize(f *os.File) (cols, rows int, ok bool) {
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	if err != nil || ws.Col == 0 || ws.Row == 0 {
		return 0, 0, false
	}
	return int(ws.Col), int(ws.Row), true
}

// notifyResize relays the terminal's size changes (SIGWINCH) to c.
func notifyResize(c chan<- os.Signal) { signal.Notify(c, unix.SIGWINCH) }
