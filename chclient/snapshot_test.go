package chclient_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
)

// TestSnapshotRestoreThroughClient suspends a VM the way the engine will: pause, snapshot,
// the process gone (here killed, so its sockets stay behind), then a new process restores
// and resumes it. A process launched without naming the vsock and serial sockets cannot
// restore over the stale ones; Launch removes them when told.
func TestSnapshotRestoreThroughClient(t *testing.T) {
	f, p := launchSim(t, "--sim-activate-delay", "0s")
	c := p.Client()
	ctx := ctxT(t)
	cfg := fullConfig(f)
	cfg.Net, cfg.Devices = nil, nil
	touch(t, cfg.Payload.Kernel)
	touch(t, cfg.Payload.Initramfs)
	touch(t, cfg.Disks[1].Path)
	vhost, err := net.Listen("unix", cfg.Disks[0].VhostSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer vhost.Close()
	go func() {
		for {
			c, err := vhost.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	if err := c.CreateVM(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.BootVM(ctx); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(f.dir, "suspend")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	url, err := chclient.FileURL(dir)
	if err != nil || url != "file://"+dir {
		t.Fatalf("FileURL(%s) = %q, %v", dir, url, err)
	}
	var apiErr *chclient.APIError
	err = c.Snapshot(ctx, url)
	if !errors.As(err, &apiErr) || apiErr.Status != 500 || apiErr.Last() != "Trying to snapshot while VM is running" ||
		apiErr.Path != "vm.snapshot" {
		t.Fatalf("Snapshot of a running VM = %v", err)
	}
	if err := c.PauseVM(ctx); err != nil {
		t.Fatal(err)
	}
	before, err := c.VMInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Snapshot(ctx, url); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{chclient.SnapshotConfigFile, chclient.SnapshotStateFile, chclient.SnapshotMemoryFile} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("snapshot file: %v", err)
		}
	}
	p.Signal(syscall.SIGKILL)
	<-p.Done()
	for _, s := range []string{f.vsock, f.serial} {
		if _, err := os.Lstat(s); err != nil {
			t.Fatalf("%s: %v; a killed CH leaves its sockets", s, err)
		}
	}

	// A process that was not told about the sockets: CH binds them and fails.
	g := newFixture(t)
	lc := g.config("--sim-activate-delay", "0s")
	lc.VsockSocket, lc.SerialSocket = "", ""
	lctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	q, err := chclient.Launch(lctx, lc)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { q.Signal(syscall.SIGKILL); <-q.Done(); q.Close() }()
	err = q.Client().Restore(ctx, &chclient.RestoreConfig{SourceURL: url, Resume: true})
	if !errors.As(err, &apiErr) || apiErr.Status != 500 || apiErr.Body[1] != "The VM could not be restored" {
		t.Fatalf("Restore over stale sockets = %v", err)
	}
	t.Logf("restore over stale sockets: %v", err)

	// Launch removes what it is told to; the restore then succeeds, and runs the VM.
	h := newFixture(t)
	lc = h.config("--sim-activate-delay", "0s")
	lc.VsockSocket, lc.SerialSocket = f.vsock, f.serial
	r, err := chclient.Launch(lctx, lc)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { r.Signal(syscall.SIGKILL); <-r.Done(); r.Close() }()
	rc := r.Client()
	if err := rc.Restore(ctx, &chclient.RestoreConfig{SourceURL: url, MemoryRestoreMode: chclient.MemoryRestoreCopy, Resume: true}); err != nil {
		t.Fatal(err)
	}
	after, err := rc.VMInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if after.State != chclient.StateRunning {
		t.Errorf("state after Restore with Resume = %s", after.State)
	}
	if !reflect.DeepEqual(after.Config, before.Config) || !reflect.DeepEqual(after.DeviceTree, before.DeviceTree) {
		t.Errorf("restored VM = %+v\nwant %+v", after, before)
	}
}

// TestSnapshotRestoreRefusedByClient: what CH would refuse anyway is caught before a
// request is sent.
func TestSnapshotRestoreRefusedByClient(t *testing.T) {
	c, recorded := recordingClient(t)
	ctx := ctxT(t)
	if _, err := chclient.FileURL("relative/dir"); err == nil {
		t.Error("FileURL accepted a relative path")
	}
	if err := c.Snapshot(ctx, "/abs/dir"); err == nil {
		t.Error("Snapshot accepted a URL without file://")
	}
	for _, rc := range []*chclient.RestoreConfig{nil, {SourceURL: "/abs/dir"},
		{SourceURL: "file:///abs/dir", Prefault: true, MemoryRestoreMode: chclient.MemoryRestoreOnDemand}} {
		if err := c.Restore(ctx, rc); err == nil {
			t.Errorf("Restore(%+v) succeeded", rc)
		}
	}
	if n := len(recorded()); n != 0 {
		t.Errorf("%d requests sent", n)
	}
}
