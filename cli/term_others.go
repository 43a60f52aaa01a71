//go:build !(linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package cli

import "os"

// rawTerminal leaves the terminal as it is: raw mode needs termios.
func rawTerminal(*os.File) (func(), bool, error) { return func() {}, false, nil }

// terminalSize knows no terminal here.
func terminalSize(*os.File) (int, int, bool) { return 0, 0, false }

// notifyResize has no SIGWINCH to relay here.
func notifyResize(chan<- os.Signal) {}
