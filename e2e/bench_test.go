//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/store"
)

// BenchmarkCreateAutoBoot measures POST /api/vms with auto_boot (root disk
// copy grown to 2 GiB, one data volume, no interfaces) from request to
// 201, through the real server, beside "children": the same child-process
// work done directly (qemu-storage-daemon launch with the root grow and
// both exports, CH launch, vm.create, vm.boot and the state checks). The
// difference is vmhost's own work: HTTP, validation, admission, record
// writes with fsync, the disk copy and qcow2 creation, the view.
//
// Variants: simulators for both, and the real qemu-storage-daemon where
// installed. The VM is deleted outside the timer after each create.
// "recordwrites" times the eight fsynced record writes such a create
// makes, the largest part of vmhost's own share.
func BenchmarkCreateAutoBoot(b *testing.B) {
	variants := []struct {
		name, simulate string
		qsd            string
	}{{"sim", "ch,qsd", ""}}
	if p, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		variants = append(variants, struct{ name, simulate, qsd string }{"realqsd", "ch", p})
	}
	for _, v := range variants {
		b.Run(v.name+"/vmhost", func(b *testing.B) {
			s := startServer(b, serverOpts{simulate: v.simulate, edit: func(c *config.Config) {
				if v.qsd != "" {
					c.Binaries.QemuStorageDaemon = v.qsd
				}
			}})
			f := newFixture(b)
			b.ResetTimer()
			for i := range b.N {
				id := fmt.Sprintf("bench%d", i)
				st, body := s.do("POST", "/api/vms", f.body(id, true, ""))
				if st != http.StatusCreated {
					b.Fatalf("POST = %d %s", st, body)
				}
				b.StopTimer()
				if st, body := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
					b.Fatalf("DELETE = %d %s", st, body)
				}
				b.StartTimer()
			}
		})
		if v.name == "sim" {
			// The durable record writes of one such create: the first
			// store, root_disk (with the vsock CID), data0, run_dir, the
			// QSD identity, display created, the CH identity, running.
			b.Run("recordwrites", func(b *testing.B) {
				dir, err := os.MkdirTemp(shortTemp(), "vhb")
				if err != nil {
					b.Fatal(err)
				}
				defer os.RemoveAll(dir)
				st, err := store.Open(dir)
				if err != nil {
					b.Fatal(err)
				}
				defer st.Close()
				rec := make([]byte, 2500) // a record of this request is ~2.3 KB
				b.ResetTimer()
				for range b.N {
					for range 8 {
						if err := st.Put("bench", rec); err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		}
		b.Run(v.name+"/children", func(b *testing.B) {
			f := newFixture(b)
			qsdBin, qsdPre := simBin, []string{"sim-qsd"}
			if v.qsd != "" {
				qsdBin, qsdPre = v.qsd, nil
			}
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				dir, err := os.MkdirTemp(shortTemp(), "vhb")
				if err != nil {
					b.Fatal(err)
				}
				// The files vmhost would have made (not timed here).
				if err := exec.Command("cp", "--sparse=always", f.base, dir+"/root.qcow2").Run(); err != nil {
					b.Fatal(err)
				}
				if err := qcow2.Create(dir+"/data0.qcow2", 1<<30); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				children(b, dir, f.kernel, qsdBin, qsdPre)
				b.StopTimer()
				os.RemoveAll(dir)
				b.StartTimer()
			}
		})
	}
}

// children runs the child-process part of a create with auto_boot in dir
// and stops both processes again (the stop is not timed).
func children(b *testing.B, dir, kernel, qsdBin string, qsdPre []string) {
	stop, err := launchChildren(dir, kernel, qsdBin, qsdPre)
	if err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	stop()
	b.StartTimer()
}

// launchChildren launches and boots what a create with auto_boot runs, in
// dir; stop ends them.
func launchChildren(dir, kernel, qsdBin string, qsdPre []string) (stop func(), err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := qmp.LaunchQSD(ctx, qmp.QSDConfig{
		Binary: qsdBin, PreArgs: qsdPre,
		Root:      qmp.RootDisk{Path: dir + "/root.qcow2", Socket: dir + "/root.vhost", Size: 2 << 30},
		Data:      []qmp.DataDisk{{ID: "data0", Path: dir + "/data0.qcow2", Socket: dir + "/data0.vhost"}},
		QMPSocket: dir + "/qsd.qmp", PidFile: dir + "/qsd.pid", LogFile: dir + "/qsd.log",
	})
	if err != nil {
		return nil, err
	}
	p, err := chclient.Launch(ctx, chclient.LaunchConfig{Binary: simBin, PreArgs: []string{"sim-ch"},
		APISocket: dir + "/ch.sock", EventMonitor: dir + "/events", LogFile: dir + "/ch.log",
		VsockSocket: dir + "/vsock.sock", SerialSocket: dir + "/console.sock"})
	if err != nil {
		q.Quit(ctx)
		return nil, err
	}
	c := p.Client()
	cfg := &chclient.VmConfig{
		Cpus:    &chclient.CpusConfig{BootVcpus: 1, MaxVcpus: 2},
		Memory:  &chclient.MemoryConfig{Size: 128 << 20, Shared: true, HotplugSize: 128 << 20},
		Payload: &chclient.PayloadConfig{Kernel: kernel, Cmdline: "console=ttyS0"},
		Disks: []chclient.DiskConfig{{VhostUser: true, VhostSocket: dir + "/root.vhost"},
			{VhostUser: true, VhostSocket: dir + "/data0.vhost"}},
		Serial:  &chclient.ConsoleConfig{Mode: chclient.ConsoleSocket, Socket: dir + "/console.sock"},
		Console: &chclient.ConsoleConfig{Mode: chclient.ConsoleOff},
		Vsock:   &chclient.VsockConfig{Cid: 3, Socket: dir + "/vsock.sock"},
		Pvpanic: true,
	}
	for _, step := range []func() error{
		func() error { return c.CreateVM(ctx, cfg) },
		func() error { _, err := c.VMInfo(ctx); return err },
		func() error { return c.BootVM(ctx) },
		func() error { _, err := c.VMInfo(ctx); return err },
	} {
		if err := step(); err != nil {
			p.Stop(ctx, 2*time.Second)
			q.Quit(ctx)
			return nil, err
		}
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		p.Stop(ctx, 2*time.Second)
		p.Close()
		q.Quit(ctx)
	}, nil
}
