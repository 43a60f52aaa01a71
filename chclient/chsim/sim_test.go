package chsim_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestBodyLimit(t *testing.T) {
	p := startSim(t)
	cfg := minimalConfig(t, p.dir)
	// Exactly at the limit is accepted (padding with JSON whitespace).
	at := cfg + strings.Repeat(" ", 51200-len(cfg))
	p.wantStatus("PUT", "/api/v1/vm.create", at, 204)
	resp, data := p.do("PUT", "/api/v1/vm.create", at+" ")
	var shape struct{ Error string }
	if resp.StatusCode != 400 || json.Unmarshal(data, &shape) != nil || !strings.Contains(shape.Error, "51200") ||
		!strings.HasSuffix(shape.Error, "\nAll previous unanswered requests will be dropped.") {
		t.Errorf("over the limit = %d %s, want micro_http's 400 {\"error\": …}", resp.StatusCode, data)
	}
}

func TestChunkedBodyRefused(t *testing.T) {
	p := startSim(t)
	resp, data := p.raw("PUT /api/v1/vm.create HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
	var shape struct{ Error string }
	if resp.StatusCode != 400 || json.Unmarshal(data, &shape) != nil || shape.Error == "" {
		t.Errorf("chunked vm.create = %d %s, want a 400 parse error", resp.StatusCode, data)
	}
	p.wantStatus("GET", "/api/v1/vm.info", "", 404)
}

func TestKeepAliveSeveralRequests(t *testing.T) {
	p := startSim(t)
	c, err := net.Dial("unix", p.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	// Two pipelined requests on one connection, answered in order.
	io.WriteString(c, "GET /api/v1/vmm.ping HTTP/1.1\r\n\r\nPUT /api/v1/vm.boot HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
	br := bufio.NewReader(c)
	for _, want := range []int{200, 404} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != want {
			t.Fatalf("status = %d %s, want %d", resp.StatusCode, body, want)
		}
	}
}

func bootWithSerialAndVsock(t testing.TB, p *simProc) (serial, vsock string) {
	t.Helper()
	serial = filepath.Join(p.dir, "console.sock")
	vsock = filepath.Join(p.dir, "vsock.sock")
	cfg := strings.TrimSuffix(minimalConfig(t, p.dir), "}")
	cfg = strings.Replace(cfg, `"serial":{"mode":"Null"}`, fmt.Sprintf(`"serial":{"mode":"Socket","socket":%q}`, serial), 1)
	cfg += fmt.Sprintf(`,"vsock":{"cid":3,"socket":%q},"pvpanic":true}`, vsock)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	if _, err := os.Stat(serial); err != nil {
		t.Fatalf("serial socket not bound at vm.create: %v", err)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	return serial, vsock
}

func TestGuestPoweroffExitsZero(t *testing.T) {
	p := startSim(t)
	serial, vsock := bootWithSerialAndVsock(t, p)
	p.waitEvents("virtio-device/activated map[id:_disk0]")
	p.wantStatus("PUT", "/sim/v1/poweroff", "", 204)
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Fatalf("exit = %v, want 0", st)
	}
	evs := p.eventsSoFar()
	var tail []string
	for _, e := range evs[len(evs)-4:] {
		tail = append(tail, e.String())
	}
	want := []string{"virtio-device/reset map[id:_vsock1]", "vm/shutdown", "vm/deleted", "vmm/shutdown"}
	if !reflect.DeepEqual(tail, want) {
		t.Errorf("last events = %v, want %v", tail, want)
	}
	p.waitEvents("virtio-device/reset map[id:_disk0]", "vm/shutdown")
	for _, path := range []string{p.sock, serial, vsock} {
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", path, err)
		}
	}
}

func TestNoShutdownPoweroffKeepsProcess(t *testing.T) {
	p := startSim(t, "--no-shutdown")
	bootWithSerialAndVsock(t, p)
	p.wantStatus("PUT", "/sim/v1/poweroff", "", 204)
	if s := p.state(); s != "Created" {
		t.Errorf("state after poweroff with --no-shutdown = %s", s)
	}
}

func TestPowerButton(t *testing.T) {
	p := startSim(t, "--sim-no-activate")
	bootWithSerialAndVsock(t, p)
	// A guest whose OS is not up ignores the button.
	p.wantStatus("PUT", "/api/v1/vm.power-button", "", 204)
	time.Sleep(200 * time.Millisecond)
	if s := p.state(); s != "Running" {
		t.Fatalf("state = %s", s)
	}
	for _, e := range p.eventsSoFar() {
		if e.Source == "virtio-device" {
			t.Fatalf("device event %v with --sim-no-activate", e)
		}
	}
	p.wantStatus("PUT", "/sim/v1/activate", "", 204)
	p.waitEvents("virtio-device/activated map[id:_disk0]", "virtio-device/activated map[id:_vsock1]")
	p.wantStatus("PUT", "/api/v1/vm.power-button", "", 204)
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Fatalf("exit = %v", st)
	}
}

func TestGuestPanic(t *testing.T) {
	p := startSim(t)
	bootWithSerialAndVsock(t, p)
	p.wantStatus("PUT", "/sim/v1/panic", `{"event":"crash_loaded"}`, 204)
	p.waitEvents("guest/panic map[event:crash_loaded]")
	if s := p.state(); s != "Running" {
		t.Errorf("state after panic = %s, want Running", s)
	}
}

// TestCounters: vm.counters lists each disk and net device with CH's
// counter names, and /sim/v1/counters moves them as guest I/O would.
func TestCounters(t *testing.T) {
	p := startSim(t)
	bootWithSerialAndVsock(t, p)
	p.wantStatus("PUT", "/sim/v1/counters", `{"device":"_disk0","counters":{"read_bytes":4096,"write_ops":3}}`, 204)
	p.wantStatus("PUT", "/sim/v1/counters", `{"device":"_disk0","counters":{"nope":1}}`, 400)
	p.wantStatus("PUT", "/sim/v1/counters", `{"device":"_nothing","counters":{"read_bytes":1}}`, 409)
	var got map[string]map[string]uint64
	if err := json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.counters", "", 200), &got); err != nil {
		t.Fatal(err)
	}
	d := got["_disk0"]
	if d["read_bytes"] != 4096 || d["write_ops"] != 3 || len(d) != 10 {
		t.Errorf("_disk0 counters = %v", d)
	}
}

func TestHang(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/sim/v1/hang", "", 204)
	c, err := net.Dial("unix", p.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, "GET /api/v1/vmm.ping HTTP/1.1\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("a hung VMM answered: %d bytes, %v", n, err)
	}
	var st struct{ Hung bool }
	json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if !st.Hung {
		t.Error("status does not report the hang")
	}
}

func TestSerialSocket(t *testing.T) {
	p := startSim(t)
	serial, _ := bootWithSerialAndVsock(t, p)
	p.waitEvents("virtio-device/activated map[id:_disk0]")
	c, err := net.Dial("unix", serial)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	// Output from before the client connected was buffered.
	line, err := br.ReadString('\n')
	if err != nil || !strings.Contains(line, "booting") {
		t.Fatalf("first serial line = %q, %v", line, err)
	}
	io.WriteString(c, "root\n")
	got, _ := br.ReadString('\n')
	if !strings.HasSuffix(got, "root\n") {
		t.Errorf("echo = %q", got)
	}
	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if _, err := os.Stat(serial); !os.IsNotExist(err) {
		t.Errorf("serial socket left after the VM stopped: %v", err)
	}
	// A new boot binds it again.
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	if _, err := os.Stat(serial); err != nil {
		t.Errorf("serial socket after reboot: %v", err)
	}
}

func TestSerialSocketExistsFailsCreate(t *testing.T) {
	p := startSim(t)
	serial := filepath.Join(p.dir, "console.sock")
	os.WriteFile(serial, nil, 0o600)
	cfg := strings.Replace(minimalConfig(t, p.dir), `"serial":{"mode":"Null"}`, fmt.Sprintf(`"serial":{"mode":"Socket","socket":%q}`, serial), 1)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 500)
	// The config is kept: delete before retrying.
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 500)
	if s := p.state(); s != "Created" {
		t.Errorf("state = %s", s)
	}
	p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
	os.Remove(serial)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
}

func TestBootValidation(t *testing.T) {
	for _, tc := range []struct {
		name, edit, want string
	}{
		{"no payload", `"payload":{"cmdline":"x"}`, "Payload configuration is not bootable"},
		{"max below boot", `"cpus":{"boot_vcpus":4,"max_vcpus":2}`, "Max CPUs lower than boot CPUs"},
		{"topology", `"cpus":{"boot_vcpus":2,"max_vcpus":2,"topology":{"threads_per_core":1,"cores_per_die":4,"dies_per_package":1,"packages":1}}`,
			"Product of CPU topology parts does not match maximum vCPU"},
		{"vhost-user without shared memory", `"disks":[{"vhost_user":true,"vhost_socket":"/x"}]`,
			"Using vhost-user requires using shared memory or huge pages"},
		{"vsock cid", `"vsock":{"cid":2,"socket":"/tmp/v"}`, "2 is a special VSOCK CID"},
		{"missing kernel", `"payload":{"kernel":"/nonexistent/vmlinux"}`, "no such file or directory"},
		{"missing disk", `"disks":[{"path":"/nonexistent/disk"}]`, "no such file or directory"},
		{"vhost-user backend down", `"memory":{"size":1073741824,"shared":true},"disks":[{"vhost_user":true,"vhost_socket":"/nonexistent/sock"}]`,
			"no such file or directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startSim(t)
			base := minimalConfig(t, p.dir)
			var m map[string]json.RawMessage
			json.Unmarshal([]byte(base), &m)
			var edit map[string]json.RawMessage
			if err := json.Unmarshal([]byte("{"+tc.edit+"}"), &edit); err != nil {
				t.Fatal(err)
			}
			for k, v := range edit {
				m[k] = v
			}
			body, _ := json.Marshal(m)
			p.wantStatus("PUT", "/api/v1/vm.create", string(body), 204)
			chain := errorChain(t, p.wantStatus("PUT", "/api/v1/vm.boot", "", 500))
			if len(chain) < 3 || chain[0] != "Error from API" || chain[1] != "The VM could not boot" || !strings.Contains(lastOf(chain), tc.want) {
				t.Errorf("boot = %q, want a chain ending with %q", chain, tc.want)
			}
			if s := p.state(); s != "Created" {
				t.Errorf("state = %s", s)
			}
		})
	}
}

func TestGeneratedIDsAndDeviceTree(t *testing.T) {
	p := startSim(t)
	extra := filepath.Join(p.dir, "data.img")
	os.WriteFile(extra, nil, 0o600)
	cfg := strings.TrimSuffix(minimalConfig(t, p.dir), "]}") // inside disks
	cfg = strings.Replace(minimalConfig(t, p.dir), `"image_type":"Raw"}]`, fmt.Sprintf(`"image_type":"Raw"},{"path":%q}]`, extra), 1)
	cfg = strings.TrimSuffix(cfg, "}") + fmt.Sprintf(`,"vsock":{"cid":3,"socket":%q}}`, filepath.Join(p.dir, "v.sock"))
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var info struct {
		Config struct {
			Disks []struct {
				ID         string
				PciSegment *int `json:"pci_segment"`
			}
			Vsock struct{ ID string }
		}
		DeviceTree map[string]struct {
			PciBdf string `json:"pci_bdf"`
		} `json:"device_tree"`
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if len(info.Config.Disks) != 2 || info.Config.Disks[0].ID != "_disk0" || info.Config.Disks[1].ID != "_disk1" || info.Config.Vsock.ID != "_vsock2" {
		t.Errorf("ids = %+v", info.Config)
	}
	if info.Config.Disks[0].PciSegment == nil {
		t.Error("pci_segment not echoed")
	}
	if !strings.HasPrefix(info.DeviceTree["_virtio-pci-_disk0"].PciBdf, "0000:00:") {
		t.Errorf("device tree = %+v", info.DeviceTree)
	}
}

func TestRebootDropsVsockConnections(t *testing.T) {
	p := startSim(t, "--sim-guest-ports", "1024")
	_, vsock := bootWithSerialAndVsock(t, p)
	c, err := net.Dial("unix", vsock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(c, "CONNECT 1024\n")
	br := bufio.NewReader(c)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "OK ") {
		t.Fatalf("handshake = %q, %v", line, err)
	}
	p.wantStatus("PUT", "/sim/v1/reboot", "", 204)
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("read after guest reboot = %v, want EOF", err)
	}
	p.waitEvents("vm/rebooting", "vm/rebooted")
	// The socket is bound again.
	c2, err := net.Dial("unix", vsock)
	if err != nil {
		t.Fatalf("vsock after reboot: %v", err)
	}
	c2.Close()
}

func TestSecondInstanceRefused(t *testing.T) {
	p := startSim(t)
	cmd := exec.Command(os.Args[0], "--api-socket", "path="+p.sock)
	cmd.Env = append(os.Environ(), "CHSIM_TEST_MAIN=1")
	out, err := cmd.CombinedOutput()
	if cmd.ProcessState.ExitCode() != 1 || !strings.Contains(string(out), "already in use") {
		t.Errorf("second instance: %v, %s", err, out)
	}
	p.wantStatus("GET", "/api/v1/vmm.ping", "", 200)
}

func TestSIGTERM(t *testing.T) {
	p := startSim(t)
	bootWithSerialAndVsock(t, p)
	p.cmd.Process.Signal(os.Interrupt)
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Fatalf("exit = %v", st)
	}
	p.waitEvents("vm/shutdown", "vm/deleted", "vmm/shutdown")
}

// TestInheritedFDs runs the simulator with --api-socket fd=N (an already listening socket)
// and --event-monitor fd=N (a pipe), as a supervisor passing descriptors would.
func TestInheritedFDs(t *testing.T) {
	dir := shortDir(t)
	sock := filepath.Join(dir, "ch.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	lf, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close() // the simulator holds the listening socket through its copy
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	cmd := exec.Command(os.Args[0], "--api-socket", "fd=3", "--event-monitor", "fd=4")
	cmd.Env = append(os.Environ(), "CHSIM_TEST_MAIN=1", "GORACE=atexit_sleep_ms=0")
	cmd.ExtraFiles = []*os.File{lf, pw}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lf.Close()
	pw.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer cmd.Process.Kill()

	hc := &http.Client{Transport: &http.Transport{Dial: func(_, _ string) (net.Conn, error) { return net.Dial("unix", sock) }}}
	req, _ := http.NewRequest("PUT", "http://x/api/v1/vmm.shutdown", nil)
	resp, err := hc.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("vmm.shutdown over the inherited socket = %v, %v", resp, err)
	}
	resp.Body.Close()
	if err := <-done; err != nil {
		t.Fatalf("exit: %v", err)
	}
	events, _ := io.ReadAll(pr)
	if !strings.Contains(string(events), `"starting"`) || !strings.Contains(string(events), `"shutdown"`) {
		t.Errorf("events through the pipe = %q", events)
	}
}

// TestVhostUserBackendHeld proves the boot connects to the vhost-user backend (as qsd would
// see it), holds the connection while the disk is plugged, and drops it on unplug.
func TestVhostUserBackendHeld(t *testing.T) {
	p := startSim(t)
	sock := filepath.Join(p.dir, "root.vhost")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cfg := strings.Replace(minimalConfig(t, p.dir), `"memory":{"size":1073741824}`, `"memory":{"size":1073741824,"shared":true}`, 1)
	cfg = strings.Replace(cfg, `"disks":[`, fmt.Sprintf(`"disks":[{"id":"root","vhost_user":true,"vhost_socket":%q},`, sock), 1)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	l.(*net.UnixListener).SetDeadline(time.Now().Add(5 * time.Second))
	backend, err := l.Accept()
	if err != nil {
		t.Fatalf("the boot did not connect to the vhost-user backend: %v", err)
	}
	defer backend.Close()
	p.wantStatus("PUT", "/api/v1/vm.remove-device", `{"id":"root"}`, 204)
	p.waitEvents("vm/device-removed map[bdf:0000:00:01.0 id:root]")
	backend.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := backend.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("backend read after unplug = %v, want EOF", err)
	}
	var info struct {
		Config struct{ Disks []struct{ ID string } }
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if len(info.Config.Disks) != 1 || info.Config.Disks[0].ID != "_disk0" {
		t.Errorf("disks after unplug = %+v", info.Config.Disks)
	}
}

// TestEjectRefused: while /sim/v1/eject refuses, vm.remove-device answers 204 but the guest
// ignores the request: the device stays in the config with its vhost-user connection, and no
// device-removed follows, even once the refusal ends (the request is lost). A request made
// after that is honoured.
func TestEjectRefused(t *testing.T) {
	p := startSim(t)
	sock := filepath.Join(p.dir, "data.vhost")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cfg := strings.Replace(minimalConfig(t, p.dir), `"memory":{"size":1073741824}`, `"memory":{"size":1073741824,"shared":true}`, 1)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var dev struct{ ID, Bdf string }
	json.Unmarshal(p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"id":"data","vhost_user":true,"vhost_socket":%q}`, sock), 200), &dev)
	l.(*net.UnixListener).SetDeadline(time.Now().Add(5 * time.Second))
	backend, err := l.Accept()
	if err != nil {
		t.Fatalf("add-disk did not connect to the vhost-user backend: %v", err)
	}
	defer backend.Close()

	for _, body := range []string{`{}`, `{"refuse":"yes"}`} {
		if resp, data := p.do("PUT", "/sim/v1/eject", body); resp.StatusCode != 400 {
			t.Errorf("eject %s = %d %s, want 400", body, resp.StatusCode, data)
		}
	}
	refusing := func() bool {
		var st struct {
			RefuseEject bool `json:"refuse_eject"`
		}
		json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st)
		return st.RefuseEject
	}
	p.wantStatus("PUT", "/sim/v1/eject", `{"refuse":true}`, 204)
	if !refusing() {
		t.Error("status does not say the guest refuses ejects")
	}
	disks := func() string {
		var info struct {
			Config struct{ Disks []struct{ ID string } }
		}
		json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
		var ids []string
		for _, d := range info.Config.Disks {
			ids = append(ids, d.ID)
		}
		return strings.Join(ids, " ")
	}
	p.wantStatus("PUT", "/api/v1/vm.remove-device", `{"id":"data"}`, 204)
	time.Sleep(300 * time.Millisecond) // 6 times the simulated guest's ack delay
	p.wantStatus("PUT", "/sim/v1/eject", `{"refuse":false}`, 204)
	if refusing() {
		t.Error("status still says the guest refuses ejects")
	}
	time.Sleep(300 * time.Millisecond)
	if evs := p.eventsSoFar(); hasEvent(evs, "vm/device-removed", "") {
		t.Fatalf("device-removed after a refused eject: %v", evs)
	}
	if got := disks(); got != "_disk0 data" {
		t.Fatalf("disks after a refused eject = %s, want _disk0 data", got)
	}
	backend.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := backend.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("backend read after a refused eject = %v, want the connection still open", err)
	}

	p.wantStatus("PUT", "/api/v1/vm.remove-device", `{"id":"data"}`, 204)
	p.waitEvents("vm/device-removed map[bdf:" + dev.Bdf + " id:data]")
	if got := disks(); got != "_disk0" {
		t.Errorf("disks after the eject = %s, want _disk0", got)
	}
}

// TestOpenAndHog: /sim/v1/open tries an open from inside the simulator's
// process and reports the errno; /sim/v1/hog makes the process take and
// touch memory (the tests of the VM's jail use both on a confined one).
func TestOpenAndHog(t *testing.T) {
	p := startSim(t)
	readable := filepath.Join(p.dir, "readable")
	if err := os.WriteFile(readable, nil, 0o400); err != nil {
		t.Fatal(err)
	}
	p.wantStatus("PUT", "/sim/v1/open", fmt.Sprintf(`{"path":%q}`, readable), 204)
	var res struct {
		Error string `json:"error"`
		Errno int    `json:"errno"`
	}
	json.Unmarshal(p.wantStatus("PUT", "/sim/v1/open", fmt.Sprintf(`{"path":%q}`, filepath.Join(p.dir, "missing")), 409), &res)
	if res.Errno != int(syscall.ENOENT) || !strings.Contains(res.Error, "missing") {
		t.Errorf("open of a missing file: %+v, want ENOENT", res)
	}
	p.wantStatus("PUT", "/sim/v1/open", `{}`, 400)
	p.wantStatus("PUT", "/sim/v1/hog", `{"mb":8}`, 204)
	p.wantStatus("PUT", "/sim/v1/hog", `{"mb":0}`, 400)
}
