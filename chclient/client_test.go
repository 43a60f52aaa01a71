package chclient_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"vmhost/chclient"
)

// fullConfig uses every VmConfig field vmhost sends.
func fullConfig(f fixture) *chclient.VmConfig {
	no := false
	return &chclient.VmConfig{
		Cpus: &chclient.CpusConfig{BootVcpus: 2, MaxVcpus: 4,
			Topology: &chclient.CpuTopology{ThreadsPerCore: 1, CoresPerDie: 2, DiesPerPackage: 1, Packages: 2},
			Affinity: []chclient.CpuAffinity{{Vcpu: 0, HostCpus: []int{0}}, {Vcpu: 1, HostCpus: []int{1}}},
			Nested:   &no},
		Memory:  &chclient.MemoryConfig{Size: 1 << 30, HotplugSize: 1 << 30, Shared: true},
		Payload: &chclient.PayloadConfig{Kernel: filepath.Join(f.dir, "vmlinux"), Cmdline: "console=ttyS0 root=/dev/vda1", Initramfs: filepath.Join(f.dir, "initrd")},
		Disks: []chclient.DiskConfig{
			{ID: "root", VhostUser: true, VhostSocket: filepath.Join(f.dir, "root.vhost"), NumQueues: 2, QueueSize: 256},
			{Path: filepath.Join(f.dir, "seed.img"), Readonly: true, ImageType: chclient.ImageRaw, Serial: "cidata",
				RateLimiterConfig: &chclient.RateLimiterConfig{Ops: &chclient.TokenBucket{Size: 100, RefillTime: 1000}}},
		},
		Net: []chclient.NetConfig{{Tap: "vmh0tap0", Mac: "02:00:00:00:00:01", Mtu: 1500,
			RateLimiterConfig: &chclient.RateLimiterConfig{Bandwidth: &chclient.TokenBucket{Size: 125000, OneTimeBurst: 250000, RefillTime: 100}}}},
		Rng:      &chclient.RngConfig{Src: "/dev/urandom"},
		Serial:   &chclient.ConsoleConfig{Mode: chclient.ConsoleSocket, Socket: f.serial},
		Console:  &chclient.ConsoleConfig{Mode: chclient.ConsoleOff},
		Vsock:    &chclient.VsockConfig{Cid: 3, Socket: f.vsock},
		Pvpanic:  true,
		Balloon:  &chclient.BalloonConfig{Size: 256 << 20, DeflateOnOom: true, FreePageReporting: true},
		Platform: &chclient.PlatformConfig{SerialNumber: "vm-1234", UUID: "8f7c2a9e-3b1d-4c5e-9f0a-1b2c3d4e5f60", OemStrings: []string{"vmhost"}},
		Devices:  []chclient.DeviceConfig{{ID: "gpu0", Path: "/sys/bus/pci/devices/0000:01:00.0/"}},
	}
}

func TestClientAgainstSimulator(t *testing.T) {
	f, p := launchSim(t, "--sim-activate-delay", "0s")
	c := p.Client()
	ctx := ctxT(t)

	ping, err := c.Ping(ctx)
	if err != nil || ping.Pid != p.Pid || ping.Version == "" {
		t.Fatalf("Ping = %+v, %v; want pid %d", ping, err, p.Pid)
	}
	_, err = c.VMInfo(ctx)
	var apiErr *chclient.APIError
	if !errors.Is(err, chclient.ErrNotFound) || !errors.As(err, &apiErr) || apiErr.Status != 404 ||
		apiErr.Last() != "VM is not created" || apiErr.Path != "vm.info" || apiErr.Method != "GET" {
		t.Fatalf("VMInfo before create = %v (%#v), want a 404 *APIError matching ErrNotFound", err, apiErr)
	}

	cfg := fullConfig(f)
	if err := c.CreateVM(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	err = c.CreateVM(ctx, cfg)
	if !errors.As(err, &apiErr) || apiErr.Status != 500 || errors.Is(err, chclient.ErrNotFound) || apiErr.Last() != "VM is already created" {
		t.Fatalf("second CreateVM = %v", err)
	}
	info, err := c.VMInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := info.Config
	if info.State != chclient.StateCreated || got.Cpus.Nested == nil || *got.Cpus.Nested ||
		got.Cpus.Topology == nil || got.Cpus.Topology.Packages != 2 || got.Memory.HotplugSize != 1<<30 || !got.Memory.Shared ||
		got.Disks[0].VhostSocket != cfg.Disks[0].VhostSocket || got.Disks[1].ImageType != "Raw" ||
		got.Net[0].Mtu != 1500 || got.Net[0].RateLimiterConfig.Bandwidth.OneTimeBurst != 250000 ||
		got.Serial.Mode != "Socket" || got.Console.Mode != "Off" || !got.Pvpanic || got.Balloon.Size != 256<<20 ||
		got.Platform.SystemSerialNumber != "vm-1234" || got.Platform.SystemUUID != cfg.Platform.UUID || got.Devices[0].ID != "gpu0" {
		t.Errorf("echoed config = %+v", got)
	}
	// Booting checks what CH checks: here the vhost-user backend is not listening.
	err = c.BootVM(ctx)
	if !errors.As(err, &apiErr) || apiErr.Status != 500 || len(apiErr.Body) < 3 || apiErr.Body[1] != "The VM could not boot" {
		t.Fatalf("BootVM without the files = %v", err)
	}
	if err := c.DeleteVM(ctx); err != nil {
		t.Fatal(err)
	}

	// A bootable subset: taps and VFIO devices need a host, tested elsewhere.
	cfg.Net, cfg.Devices = nil, nil
	touch(t, cfg.Payload.Kernel)
	touch(t, cfg.Payload.Initramfs)
	touch(t, cfg.Disks[1].Path)
	vhost, err := net.Listen("unix", cfg.Disks[0].VhostSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer vhost.Close()
	if err := c.CreateVM(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if err := c.BootVM(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := c.VMInfo(ctx); err != nil || info.State != chclient.StateRunning || info.DeviceTree == nil {
		t.Fatalf("VMInfo after boot = %+v, %v", info, err)
	}
	if err := c.PauseVM(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.PauseVM(ctx); err == nil {
		t.Fatal("pausing a paused VM succeeded")
	}
	if err := c.ResumeVM(ctx); err != nil {
		t.Fatal(err)
	}
	dev, err := c.AddDisk(ctx, &chclient.DiskConfig{Path: touch(t, filepath.Join(f.dir, "data.img")), ImageType: chclient.ImageRaw})
	if err != nil || dev == nil || !strings.HasPrefix(dev.ID, "_disk") || !strings.HasPrefix(dev.Bdf, "0000:00:") {
		t.Fatalf("AddDisk = %+v, %v", dev, err)
	}
	counters, err := c.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := counters[dev.ID]["write_bytes"]; !ok {
		t.Errorf("counters = %v, want %s", counters, dev.ID)
	}
	if err := c.RemoveDevice(ctx, dev.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveDevice(ctx, "nope"); err == nil {
		t.Error("removing an unknown device succeeded")
	}
	if err := c.Resize(ctx, &chclient.VmResize{DesiredVcpus: 3}); err != nil {
		t.Fatal(err)
	}
	if err := c.RebootVM(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.ShutdownVM(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := c.VMInfo(ctx); err != nil || info.State != chclient.StateCreated {
		t.Fatalf("VMInfo after shutdown = %+v, %v", info, err)
	}
	// A cold add answers 204: no device info.
	if dev, err := c.AddDisk(ctx, &chclient.DiskConfig{Path: filepath.Join(f.dir, "cold.img")}); err != nil || dev != nil {
		t.Fatalf("cold AddDisk = %+v, %v", dev, err)
	}
	if err := c.ShutdownVMM(ctx); err != nil {
		t.Fatal(err)
	}
	if st, ok := p.Exit(); !ok || st.Code != 0 || st.Signaled() {
		t.Errorf("exit after vmm.shutdown = %v", st)
	}
}

// recordingConn keeps every byte the client writes.
type recordingConn struct {
	net.Conn
	mu  *sync.Mutex
	buf *bytes.Buffer
}

func (c recordingConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.buf.Write(b)
	c.mu.Unlock()
	return c.Conn.Write(b)
}

func TestClientSendsContentLength(t *testing.T) {
	f, _ := launchSim(t)
	var mu sync.Mutex
	var buf bytes.Buffer
	c := chclient.New(f.sock)
	c.Dial = func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", f.sock)
		return recordingConn{conn, &mu, &buf}, err
	}
	ctx := ctxT(t)
	if err := c.CreateVM(ctx, fullConfig(f)); err != nil {
		t.Fatal(err)
	}
	if err := c.BootVM(ctx); err == nil {
		t.Fatal("boot succeeded without its files")
	}
	mu.Lock()
	wire := buf.String()
	mu.Unlock()
	reqs := strings.Split(wire, "PUT /api/v1/")
	if len(reqs) != 3 {
		t.Fatalf("wire = %q, want two PUTs", wire)
	}
	for _, r := range reqs[1:] {
		head, _, _ := strings.Cut(r, "\r\n\r\n")
		if !strings.Contains(head, "\r\nContent-Length: ") || strings.Contains(strings.ToLower(head), "transfer-encoding") {
			t.Errorf("request head %q: want Content-Length and no Transfer-Encoding", head)
		}
	}
	if !strings.Contains(wire, "vm.boot HTTP/1.1\r\n") || !strings.Contains(wire, "Content-Length: 0\r\n") {
		t.Errorf("vm.boot must go out with Content-Length: 0: %q", wire)
	}
}

func TestClientHonoursContext(t *testing.T) {
	f, _ := launchSim(t)
	c := chclient.New(f.sock)
	ctx := ctxT(t)
	// A hung VMM: the call must end with the context.
	hang, _ := http.NewRequest("PUT", "http://x/sim/v1/hang", nil)
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return net.Dial("unix", f.sock)
	}}}
	resp, err := hc.Do(hang)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("hang = %v, %v", resp, err)
	}
	resp.Body.Close()
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := c.Ping(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Ping on a hung VMM = %v, want context.DeadlineExceeded", err)
	}
}

// TestEchoedConfigIsACreateBody feeds vm.info's config back into vm.create: CH's echo is a
// complete VmConfig, so the simulator must accept it and echo it unchanged.
func TestEchoedConfigIsACreateBody(t *testing.T) {
	f, _ := launchSim(t)
	hc := simHTTP(f)
	put := func(path, body string, want int) []byte {
		t.Helper()
		method := "PUT"
		if path == "vm.info" {
			method = "GET"
		}
		req, _ := http.NewRequest(method, "http://x/api/v1/"+path, strings.NewReader(body))
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != want {
			t.Fatalf("%s = %d %s", path, resp.StatusCode, data)
		}
		return data
	}
	configOf := func() string {
		var info struct{ Config json.RawMessage }
		json.Unmarshal(put("vm.info", "", 200), &info)
		return string(info.Config)
	}
	body, _ := json.Marshal(fullConfig(f))
	put("vm.create", string(body), 204)
	first := configOf()
	put("vm.delete", "", 204)
	put("vm.create", first, 204)
	if second := configOf(); second != first {
		t.Errorf("echo of the echo differs:\n%s\n%s", first, second)
	}
	for _, want := range []string{`"nested":false`, `"image_type":"Raw"`, `"system_serial_number":"vm-1234"`, `"console":{"mode":"Off"`, `"thp":true`} {
		if !strings.Contains(first, want) {
			t.Errorf("echo lacks %s: %s", want, first)
		}
	}
}

// closeNotingConn closes closed when the client closes it.
type closeNotingConn struct {
	net.Conn
	once   *sync.Once
	closed chan struct{}
}

func (c closeNotingConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// TestClientDropsIdleConnection: after a call the client keeps its
// connection only briefly, so an idle VM costs the agent no connection
// (nor net/http's two goroutines for it).
func TestClientDropsIdleConnection(t *testing.T) {
	f, _ := launchSim(t)
	c := chclient.New(f.sock)
	closed := make(chan struct{})
	var once sync.Once
	c.Dial = func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", f.sock)
		return closeNotingConn{conn, &once, closed}, err
	}
	if _, err := c.Ping(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the idle connection is still open 10 s after the call")
	}
}
