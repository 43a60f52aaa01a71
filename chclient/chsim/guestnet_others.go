//go:build !linux

package chsim

import (
	"os"
	"os/exec"
)

type guestNIC struct{}

func startInNetns(cmd *exec.Cmd, mac string) (*guestNIC, error) { return nil, errNotLinux }

func (n *guestNIC) pump(host *os.File) {}

func (n *guestNIC) close() {}
