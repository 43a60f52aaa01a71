//go:build !linux

package doctor

import "errors"

// errNotLinux is every Linux-only check's answer elsewhere: vmhost runs VMs
// on Linux hosts only.
var errNotLinux = errors.New("vmhost runs VMs on Linux only")

func checkKVM(dev string) Check {
	return Check{Name: "kvm", Status: Fail, Detail: errNotLinux.Error(), Fix: "run vmhost on a Linux host"}
}

func checkTun(dev string) Check {
	return Check{Name: "tun", Status: Fail, Detail: errNotLinux.Error(), Fix: "run vmhost on a Linux host"}
}

func nftablesUsable() error { return errNotLinux }

func statFS(dir string) (string, uint64, error) { return "", 0, errNotLinux }

func canReflink(dir string) (bool, error) { return false, errNotLinux }
