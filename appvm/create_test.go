package appvm_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/qcow2"
	"vmhost/vm"
	"vmhost/vm/vmtest"
)

func ptr[T any](v T) *T { return &v }

// appEnv is a vmtest.Env with the host end of its AppVMs' guest agents.
type appEnv struct {
	*vmtest.Env
	guests *appvm.Guests
}

// newApps returns the AppVM service over vms and the env's records, with
// the host end of its guest agents; the initramfs holds a small file as
// the agent's binary.
func newApps(t testing.TB, e *vmtest.Env, vms *vm.Service) (*appvm.Service, *appvm.Guests) {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "vmhost")
	if err := os.WriteFile(bin, []byte("agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	guests := appvm.NewGuests(appvm.GuestOptions{Records: e.Records, Config: e.Config, Layout: vms.Layout(),
		Now: func() time.Time { return e.Now }, Binary: bin, Logger: e.Logger, Events: e.Events})
	return appvm.New(appvm.Config{VMs: vms, Records: e.Records, Guests: guests, RootDisks: e.Host}), guests
}

// newEnv returns an env with catalog images "web" (ready, 1 GiB),
// "pending" (importing) and "broken" (failed).
func newEnv(t *testing.T) (*appEnv, *vm.Service, *appvm.Service) {
	t.Helper()
	e := &appEnv{Env: vmtest.NewEnv(t)}
	vms := e.Service(t)
	var apps *appvm.Service
	apps, e.guests = newApps(t, e.Env, vms)
	for _, im := range []*appvm.Image{
		{ID: "web", Status: appvm.StatusReady, CreatedAt: e.Now, Workload: vm.Workload{
			BuildDigest: "sha256:1a2b3c4d", SizeBytes: 1 << 30,
			Entrypoint: []string{"/entry.sh"}, Cmd: []string{"serve", "--port", "80"},
			Env: []string{"PATH=/usr/bin:/bin", "MODE=prod"}, Workdir: "/srv", User: "www",
			Healthcheck: &vm.Healthcheck{Test: []string{"CMD", "true"}, IntervalSecs: 30, TimeoutSecs: 5, Retries: 3},
		}},
		{ID: "pending", Status: appvm.StatusImporting, CreatedAt: e.Now},
		{ID: "broken", Status: appvm.StatusFailed, CreatedAt: e.Now, Failure: "layer digest mismatch"},
	} {
		if err := apps.Catalog().Put(im); err != nil {
			t.Fatal(err)
		}
	}
	if err := qcow2.Create(apps.Catalog().BuildFile("web", "sha256:1a2b3c4d"), 1<<30); err != nil {
		t.Fatal(err)
	}
	return e, vms, apps
}

func baseReq() appvm.CreateRequest {
	return appvm.CreateRequest{ImageID: "web", Vcpus: 1, MemoryMB: 256, DiskGiB: 2}
}

func envList(n int, f func(i int) string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = f(i)
	}
	return out
}

func secrets(s []string) []vm.Secret {
	out := make([]vm.Secret, len(s))
	for i, v := range s {
		out[i] = vm.Secret(v)
	}
	return out
}

// TestCreateRules pairs, for every AppVM rule of docs/api.md (POST /api/appvm/vms), a
// rejected value (400) with the accepted boundary value beside it.
func TestCreateRules(t *testing.T) {
	_, _, apps := newEnv(t)
	type mut = func(*appvm.CreateRequest)
	long := func(n int) string { return "K=" + strings.Repeat("v", n-2) }
	tests := []struct {
		name, field    string
		reject, accept mut
	}{
		{"vm_id pattern", "vm_id", func(r *appvm.CreateRequest) { r.VMID = ".x" }, func(r *appvm.CreateRequest) { r.VMID = "x." }},
		{"unknown image", "image_id", func(r *appvm.CreateRequest) { r.ImageID = "nope" }, func(r *appvm.CreateRequest) { r.ImageID = "web" }},
		{"failed image", "image_id", func(r *appvm.CreateRequest) { r.ImageID = "broken" }, func(r *appvm.CreateRequest) {}},
		{"invalid image id", "image_id", func(r *appvm.CreateRequest) { r.ImageID = "../web" }, func(r *appvm.CreateRequest) {}},
		{"vcpus minimum", "vcpus", func(r *appvm.CreateRequest) { r.Vcpus = 0 }, func(r *appvm.CreateRequest) { r.Vcpus = 1 }},
		{"memory minimum", "memory_mb", func(r *appvm.CreateRequest) { r.MemoryMB = 63 }, func(r *appvm.CreateRequest) { r.MemoryMB = 64 }},
		{"memory maximum", "memory_mb", func(r *appvm.CreateRequest) { r.MemoryMB = vm.MaxMemoryMB + 1 }, func(r *appvm.CreateRequest) { r.MemoryMB = 64 }},
		{"disk_bps_total maximum", "disk_bps_total", func(r *appvm.CreateRequest) { r.DiskBpsTotal = vm.MaxIOLimit + 1 }, func(r *appvm.CreateRequest) { r.DiskBpsTotal = vm.MaxIOLimit }},
		{"disk_iops_total maximum", "disk_iops_total", func(r *appvm.CreateRequest) { r.DiskIopsTotal = ^uint64(0) }, func(r *appvm.CreateRequest) { r.DiskIopsTotal = vm.MaxIOLimit }},
		{"disk_gib minimum", "disk_gib", func(r *appvm.CreateRequest) { r.DiskGiB = 0 }, func(r *appvm.CreateRequest) { r.DiskGiB = 1 }},
		{"disk_gib maximum", "disk_gib", func(r *appvm.CreateRequest) { r.DiskGiB = 65536 }, func(r *appvm.CreateRequest) { r.DiskGiB = 65535 }},
		{"unknown network", "network_id", func(r *appvm.CreateRequest) { r.NetworkID = "nope" }, func(r *appvm.CreateRequest) { r.NetworkID = "lab" }},
		{"rule 3: ip alone", "prefix", func(r *appvm.CreateRequest) { r.IP = ptr("10.0.0.5") }, func(r *appvm.CreateRequest) {}},
		{"rule 3: gateway missing", "gateway", func(r *appvm.CreateRequest) { r.IP, r.Prefix = ptr("10.0.0.5"), ptr[uint32](24) }, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1")
		}},
		{"rule 3: ip missing", "ip", func(r *appvm.CreateRequest) { r.Prefix, r.Gateway = ptr[uint32](24), ptr("10.0.0.1") }, func(r *appvm.CreateRequest) {}},
		{"rule 4: dns in DHCP mode", "dns", func(r *appvm.CreateRequest) { r.DNS = []string{"1.1.1.1"} }, func(r *appvm.CreateRequest) { r.DNS = []string{} }},
		{"rule 2: dns in static mode", "dns[0]", func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway, r.DNS = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1"), []string{"one.one"}
		}, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway, r.DNS = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1"), []string{"1.1.1.1"}
		}},
		{"static ip syntax", "ip", func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5/24"), ptr[uint32](24), ptr("10.0.0.1")
		}, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1")
		}},
		{"prefix minimum", "prefix", func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](0), ptr("10.0.0.1")
		}, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](1), ptr("10.0.0.1")
		}},
		{"prefix maximum", "prefix", func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](33), ptr("10.0.0.1")
		}, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](32), ptr("10.0.0.1")
		}},
		{"gateway syntax", "gateway", func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](24), ptr("fd00::1")
		}, func(r *appvm.CreateRequest) {
			r.IP, r.Prefix, r.Gateway = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1")
		}},
		{"hostname", "hostname", func(r *appvm.CreateRequest) { r.Hostname = "web_1" }, func(r *appvm.CreateRequest) { r.Hostname = "  web-1  " }},
		{"env key", "env[0]", func(r *appvm.CreateRequest) { r.Env = []string{"1A=x"} }, func(r *appvm.CreateRequest) { r.Env = []string{"_A1=x"} }},
		{"env not KEY=VALUE", "env[0]", func(r *appvm.CreateRequest) { r.Env = []string{"A"} }, func(r *appvm.CreateRequest) { r.Env = []string{"A="} }},
		{"env value newline", "env[0]", func(r *appvm.CreateRequest) { r.Env = []string{"A=x\ny"} }, func(r *appvm.CreateRequest) { r.Env = []string{"A=x y=z"} }},
		{"env value NUL", "env[0]", func(r *appvm.CreateRequest) { r.Env = []string{"A=x\x00"} }, func(r *appvm.CreateRequest) { r.Env = []string{"A=x\t"} }},
		{"env count", "env", func(r *appvm.CreateRequest) {
			r.Env = envList(101, func(i int) string { return fmt.Sprintf("K%d=v", i) })
		}, func(r *appvm.CreateRequest) {
			r.Env = envList(100, func(i int) string { return fmt.Sprintf("K%d=v", i) })
		}},
		{"env size", "env[0]", func(r *appvm.CreateRequest) { r.Env = []string{long(8193)} }, func(r *appvm.CreateRequest) { r.Env = []string{long(8192)} }},
		{"env duplicate key", "secret_env[0]", func(r *appvm.CreateRequest) { r.Env, r.SecretEnv = []string{"A=1"}, secrets([]string{"A=2"}) }, func(r *appvm.CreateRequest) {
			r.Env, r.SecretEnv = []string{"A=1"}, secrets([]string{"B=2"})
		}},
		{"secret_env key", "secret_env[0]", func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{"A-B=x"}) }, func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{"A_B=x"}) }},
		{"secret_env value", "secret_env[0]", func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{"A=x\r"}) }, func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{"A=x"}) }},
		{"secret_env count", "secret_env", func(r *appvm.CreateRequest) {
			r.SecretEnv = secrets(envList(101, func(i int) string { return fmt.Sprintf("S%d=v", i) }))
		}, func(r *appvm.CreateRequest) {
			r.SecretEnv = secrets(envList(100, func(i int) string { return fmt.Sprintf("S%d=v", i) }))
		}},
		{"secret_env size", "secret_env[0]", func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{long(8193)}) }, func(r *appvm.CreateRequest) { r.SecretEnv = secrets([]string{long(8192)}) }},
		{"data_volumes count", "data_volumes", func(r *appvm.CreateRequest) {
			for i := range 9 {
				r.DataVolumes = append(r.DataVolumes, appvm.DataVolumeRequest{SizeGiB: 1, Mountpoint: fmt.Sprintf("/d%d", i)})
			}
		}, func(r *appvm.CreateRequest) {
			for i := range 8 {
				r.DataVolumes = append(r.DataVolumes, appvm.DataVolumeRequest{SizeGiB: 1, Mountpoint: fmt.Sprintf("/d%d", i)})
			}
		}},
		{"data_volumes size", "data_volumes[0].size_gib", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{0, "/d"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/d"}}
		}},
		{"mountpoint absolute", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "data"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/data"}}
		}},
		{"mountpoint root", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/a"}}
		}},
		{"mountpoint empty segment", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var//lib"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/lib"}}
		}},
		{"mountpoint trailing slash", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var"}}
		}},
		{"mountpoint dot", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/./lib"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/.lib"}}
		}},
		{"mountpoint dotdot", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/../etc"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/var/..etc"}}
		}},
		{"mountpoint control", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/da\tta"}} }, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/da ta"}}
		}},
		{"mountpoint length", "data_volumes[0].mountpoint", func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/" + strings.Repeat("é", 256)}}
		}, func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/" + strings.Repeat("é", 255)}}
		}},
		{"mountpoint unique", "data_volumes[1].mountpoint", func(r *appvm.CreateRequest) {
			r.DataVolumes = []appvm.DataVolumeRequest{{1, "/data"}, {1, "/data"}}
		}, func(r *appvm.CreateRequest) { r.DataVolumes = []appvm.DataVolumeRequest{{1, "/data"}, {1, "/data2"}} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := baseReq()
			tt.reject(&req)
			req.AutoBoot = ptr(false)
			_, err := apps.Create(context.Background(), &req)
			var fe *vm.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("rejected case: Create = %v, want a *FieldError on %s", err, tt.field)
			}
			if fe.Field != tt.field {
				t.Errorf("rejected case: field = %q (%v), want %q", fe.Field, fe, tt.field)
			}
			if strings.Contains(fe.Error(), "x\r") || strings.Contains(fe.Error(), "=2") {
				t.Errorf("message %q echoes an env value", fe)
			}
			req = baseReq()
			tt.accept(&req)
			req.AutoBoot = ptr(false)
			if _, err := apps.Create(context.Background(), &req); err != nil {
				t.Errorf("accepted boundary: Create = %v, want nil", err)
			}
		})
	}
}

func TestCreateImportingImageConflicts(t *testing.T) {
	_, _, apps := newEnv(t)
	req := baseReq()
	req.ImageID = "pending"
	_, err := apps.Create(context.Background(), &req)
	var ce *appvm.ConflictError
	if !errors.As(err, &ce) {
		t.Fatalf("Create from an importing image = %v, want *ConflictError", err)
	}
	// A 400 rule still wins over the import status (400 before 409).
	req.Vcpus = 0
	_, err = apps.Create(context.Background(), &req)
	var fe *vm.FieldError
	if !errors.As(err, &fe) {
		t.Fatalf("Create with vcpus 0 from an importing image = %v, want *FieldError", err)
	}
}

func TestCreateBootsByDefault(t *testing.T) {
	e, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "a1"
	resp, err := apps.Create(context.Background(), &req)
	if err != nil {
		t.Fatal(err)
	}
	if *resp != (appvm.CreateResponse{ID: "a1", Mode: "appvm", ImageID: "web", Booted: true}) {
		t.Errorf("response = %+v", resp)
	}
	if got, want := e.Host.Transcript(), "preflight a1\nprovision a1\nboot a1"; got != want {
		t.Errorf("host calls:\n%s\nwant:\n%s", got, want)
	}
	rec, err := vms.Get(vm.ModeAppVM, "a1")
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != vm.StateRunning || rec.DisplayState != vm.DisplayBooting {
		t.Errorf("state = %s/%s, want running/booting", rec.State, rec.DisplayState)
	}
	if _, err := vms.Get(vm.ModeVM, "a1"); err == nil {
		t.Error("an AppVM id was found as a classic VM")
	}
	if h := appvm.Hostname(rec); !strings.HasPrefix(h, "appvm-") || len(h) != len("appvm-")+6 || !strings.HasSuffix(strings.ReplaceAll(rec.NICs[0].MAC, ":", ""), h[6:]) {
		t.Errorf("derived hostname %q from MAC %s", h, rec.NICs[0].MAC)
	}
}

// TestCreateWithoutDefaultNetwork: with NoDefaultNetwork (serve --dev) an
// AppVM that names no network has no interface at all: no nets, no NIC, no
// tap to make; network_mode none, in its view and in the spec its guest
// agent gets, which waits for no lease; its hostname is its id. One that
// names a network, or a static address, has its interface as ever.
func TestCreateWithoutDefaultNetwork(t *testing.T) {
	e, vms, _ := newEnv(t)
	apps := appvm.New(appvm.Config{VMs: vms, Records: e.Records, Guests: e.guests, RootDisks: e.Host, NoDefaultNetwork: true})
	ctx := context.Background()
	req := baseReq()
	req.VMID = "bare"
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	rec, err := vms.Get(vm.ModeAppVM, "bare")
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Spec.Nets) != 0 || len(rec.NICs) != 0 || rec.AppVM.NetworkMode != appvm.NetworkNone {
		t.Errorf("nets %v, nics %v, network_mode %q; want none of them", rec.Spec.Nets, rec.NICs, rec.AppVM.NetworkMode)
	}
	v := apps.View(rec, vm.ViewOptions{})
	if v.AppVM.NetworkMode != "none" || len(v.Nets) != 0 || v.AppVM.Hostname != "bare" {
		t.Errorf("view: network_mode %q, nets %v, hostname %q", v.AppVM.NetworkMode, v.Nets, v.AppVM.Hostname)
	}
	if sp := appvm.GuestSpec(rec, 0); sp.Network.Mode != "none" || sp.Hostname != "bare" {
		t.Errorf("guest spec network %+v, hostname %q", sp.Network, sp.Hostname)
	}
	// The guest said hello and has no lease: it is not waiting for one.
	if _, err := e.Records.Update("bare", func(r *vm.Record) { r.AppVM.Guest = &vm.AppVMGuest{BootID: "b1"} }); err != nil {
		t.Fatal(err)
	}
	rec, _ = vms.Get(vm.ModeAppVM, "bare")
	if v := apps.View(rec, vm.ViewOptions{}); v.AppVM.WaitingFor != "" {
		t.Errorf("waiting_for %q on an AppVM without a network", v.AppVM.WaitingFor)
	}

	req = baseReq()
	req.VMID, req.NetworkID = "named", "lab"
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	req = baseReq()
	req.VMID, req.IP, req.Prefix, req.Gateway = "static", ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1")
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	for id, mode := range map[string]string{"named": appvm.NetworkDHCP, "static": appvm.NetworkStatic} {
		rec, _ := vms.Get(vm.ModeAppVM, id)
		if len(rec.Spec.Nets) != 1 || len(rec.NICs) != 1 || rec.AppVM.NetworkMode != mode {
			t.Errorf("%s: nets %v, nics %v, network_mode %q; want one interface, %s", id, rec.Spec.Nets, rec.NICs, rec.AppVM.NetworkMode, mode)
		}
	}
}
