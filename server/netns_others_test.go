//go:build !linux

package server

import "errors"

// setNetNS fails: network namespaces are Linux's.
func setNetNS(fd int) error { return errors.New("no network namespaces on this system") }
