//go:build !linux

package chsim

import (
	"fmt"
	"os"
)

func kvmBootsStockKernels() (bool, string) { return false, "KVM is used on Linux only: TCG" }

func socketpair(name string) (parent, child *os.File, err error) {
	return nil, nil, fmt.Errorf("creating the %s socketpair: %w", name, errNotLinux)
}
