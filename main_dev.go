package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"vmhost/chclient/chsim"
	"vmhost/vm/engine"
)

// devSimKernelFile is the stand-in for appvm_kernel that serve --dev writes
// in its state directory when the configuration names none and Cloud
// Hypervisor is simulated: the simulator opens the payload's files but boots
// nothing, so any file will do.
const devSimKernelFile = "dev-appvm-kernel"

// devAppVMs sets up what lets a newcomer try AppVMs in dev mode on the CH
// simulator (serve --dev; not with --simulate none): the simulator runs each
// workload chrooted into the image's own tree, which the engine unpacks from
// the root disk before each boot, and an AppVM kernel stands in when none is
// configured. Production's rules are untouched: the placeholder exists only
// where no real kernel would boot, and an agent with a real Cloud
// Hypervisor still refuses AppVMs without appvm_kernel (400).
func devAppVMs(env serveEnv, eo *engine.Options) error {
	if !env.Dev || !env.SimCH {
		return nil
	}
	eo.CH.PreArgs = append(eo.CH.PreArgs, "--sim-guest-chroot")
	eo.CH.ExecRunDir = true // the workload runs from the tree there
	eo.SimGuestRoot = chsim.GuestRoot
	if env.Config.AppVMKernel != "" {
		return nil
	}
	path, err := devSimKernel(env.StateDir)
	if err != nil {
		return err
	}
	env.Config.AppVMKernel = path
	env.Log.Info("dev mode: AppVMs boot a placeholder kernel on the simulator (appvm_kernel is not set)", "appvm_kernel", path)
	return nil
}

// devSimKernel writes the placeholder kernel in stateDir, unless it is
// there, and returns its path. It is readable by all, as a kernel must be
// for a confined Cloud Hypervisor (the simulator, as root, runs as the
// VM's uid).
func devSimKernel(stateDir string) (string, error) {
	path := filepath.Join(stateDir, devSimKernelFile)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, fs.ErrExist) {
		return path, os.Chmod(path, 0o644) // one an older agent made 0600
	}
	if err != nil {
		return "", fmt.Errorf("writing the dev AppVM kernel: %w", err)
	}
	_, err = fmt.Fprintln(f, "vmhost serve --dev: not a kernel. The Cloud Hypervisor simulator boots nothing; this file stands in for appvm_kernel.")
	return path, errors.Join(err, f.Close())
}
