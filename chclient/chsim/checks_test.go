package chsim_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The tests below are the "checks a fake must pass" of docs/ref/cloud-hypervisor.md, numbered
// as there, run against the simulator as a separate process.

func TestCheck01Ping(t *testing.T) {
	p := startSim(t)
	data := p.wantStatus("GET", "/api/v1/vmm.ping", "", 200)
	var ping struct {
		BuildVersion *string   `json:"build_version"`
		Version      *string   `json:"version"`
		Pid          *int      `json:"pid"`
		Features     *[]string `json:"features"`
	}
	if err := json.Unmarshal(data, &ping); err != nil {
		t.Fatal(err)
	}
	if ping.BuildVersion == nil || ping.Version == nil || ping.Pid == nil || ping.Features == nil {
		t.Fatalf("vmm.ping = %s, want build_version, version, pid and features", data)
	}
	if *ping.Pid != p.cmd.Process.Pid {
		t.Errorf("pid = %d, want %d", *ping.Pid, p.cmd.Process.Pid)
	}
}

func TestCheck02InfoBeforeCreate(t *testing.T) {
	p := startSim(t)
	data := p.wantStatus("GET", "/api/v1/vm.info", "", 404)
	want := []string{"Error from API", "The VM info is not available", "VM is not created"}
	if got := errorChain(t, data); !reflect.DeepEqual(got, want) {
		t.Errorf("body = %q, want %q", got, want)
	}
}

func TestCheck03Create(t *testing.T) {
	p := startSim(t)
	cfg := minimalConfig(t, p.dir)
	resp, data := p.do("PUT", "/api/v1/vm.create", cfg)
	if resp.StatusCode != 204 || len(data) != 0 || resp.Header.Get("Content-Type") != "" || resp.Header.Get("Content-Length") != "" {
		t.Fatalf("vm.create = %d %v %q, want 204 with no body, no Content-Type, no Content-Length", resp.StatusCode, resp.Header, data)
	}
	data = p.wantStatus("PUT", "/api/v1/vm.create", cfg, 500)
	if got := lastOf(errorChain(t, data)); got != "VM is already created" {
		t.Errorf("second vm.create ends %q", got)
	}
}

func TestCheck04CreateBadJSON(t *testing.T) {
	for _, body := range []string{`{"cpus":`, `{"cpus":{"max_vcpus":2}}`, `{"console":{"mode":"Bogus"}}`,
		`{"net":[{"rate_limiter_config":{"bandwidth":{"size":1,"refill_time":1},"bogus":1}}]}`} {
		p := startSim(t)
		data := p.wantStatus("PUT", "/api/v1/vm.create", body, 400)
		if chain := errorChain(t, data); len(chain) == 0 || chain[0] != "Failed to deserialize JSON" {
			t.Errorf("vm.create %s = %q, want a chain starting with \"Failed to deserialize JSON\"", body, chain)
		}
		p.wantStatus("GET", "/api/v1/vm.info", "", 404)
	}
}

func TestCheck05InfoAfterCreate(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", `{"payload":{"kernel":"/nonexistent"}}`, 204)
	data := p.wantStatus("GET", "/api/v1/vm.info", "", 200)
	var info map[string]json.RawMessage
	if err := json.Unmarshal(data, &info); err != nil {
		t.Fatal(err)
	}
	if string(info["state"]) != `"Created"` {
		t.Errorf("state = %s", info["state"])
	}
	if _, ok := info["device_tree"]; ok {
		t.Errorf("vm.info has device_tree before boot: %s", data)
	}
	var cfg struct {
		Console struct{ Mode string }
		Cpus    struct {
			BootVcpus int `json:"boot_vcpus"`
		}
		Memory struct{ Size uint64 }
	}
	json.Unmarshal(info["config"], &cfg)
	if cfg.Console.Mode != "Tty" || cfg.Cpus.BootVcpus != 1 || cfg.Memory.Size != 512<<20 {
		t.Errorf("echoed defaults = %+v, want console Tty, 1 vCPU, 512 MiB", cfg)
	}
}

func TestCheck06Boot(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	resp, data := p.do("PUT", "/api/v1/vm.boot", "")
	if resp.StatusCode != 204 || len(data) != 0 {
		t.Fatalf("vm.boot = %d %q", resp.StatusCode, data)
	}
	if s := p.state(); s != "Running" {
		t.Errorf("state = %s", s)
	}
	p.waitEvents("vmm/starting", "vm/booting", "vm/booted", "virtio-device/activated map[id:_disk0]")
}

func TestCheck07BootErrors(t *testing.T) {
	p := startSim(t)
	data := p.wantStatus("PUT", "/api/v1/vm.boot", "", 404)
	if got := lastOf(errorChain(t, data)); got != "VM config is missing" {
		t.Errorf("boot without config ends %q", got)
	}
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	data = p.wantStatus("PUT", "/api/v1/vm.boot", "", 500)
	if got := lastOf(errorChain(t, data)); got != "VM is already created" {
		t.Errorf("second boot ends %q", got)
	}
}

func TestCheck08BodyOnBodylessAction(t *testing.T) {
	p := startSim(t)
	for _, path := range []string{"vm.boot", "vm.shutdown", "vm.reboot", "vm.pause", "vm.resume", "vm.power-button", "vm.delete", "vm.nmi"} {
		data := p.wantStatus("PUT", "/api/v1/"+path, `{"x":1}`, 400)
		if got := errorChain(t, data); !reflect.DeepEqual(got, []string{"Bad Request"}) {
			t.Errorf("%s with a body = %q", path, got)
		}
	}
}

func TestCheck09PauseResume(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	if s := p.state(); s != "Paused" {
		t.Errorf("state = %s", s)
	}
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 500)
	p.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	if s := p.state(); s != "Running" {
		t.Errorf("state = %s", s)
	}
	p.wantStatus("PUT", "/api/v1/vm.resume", "", 500)
	p.waitEvents("vm/pausing", "vm/paused", "vm/resuming", "vm/resumed")
}

func TestCheck10Shutdown(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	data := p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 500)
	if got := lastOf(errorChain(t, data)); got != "VM is not running" {
		t.Errorf("shutdown of a created VM ends %q", got)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if s := p.state(); s != "Created" {
		t.Errorf("state after shutdown = %s, want Created", s)
	}
	p.waitEvents("vm/booted", "vm/shutdown")
	// The config is kept: the VM boots again.
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
}

func TestCheck11Reboot(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.reboot", "", 404)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.reboot", "", 204)
	p.waitEvents("vm/booted", "vm/rebooting", "vm/rebooted")
	var ping struct{ Pid int }
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vmm.ping", "", 200), &ping)
	if ping.Pid != p.cmd.Process.Pid {
		t.Errorf("pid after reboot = %d, want %d", ping.Pid, p.cmd.Process.Pid)
	}
	if s := p.state(); s != "Running" {
		t.Errorf("state = %s", s)
	}
}

func TestCheck12Delete(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
	p.wantStatus("GET", "/api/v1/vm.info", "", 404)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
	p.wantStatus("GET", "/api/v1/vm.info", "", 404)
	p.waitEvents("vm/deleted", "vm/booted", "vm/shutdown", "vm/deleted")
}

func TestCheck13VMMShutdown(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	resp, data := p.do("PUT", "/api/v1/vmm.shutdown", "")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Length") != "0" || len(data) != 0 {
		t.Fatalf("vmm.shutdown = %d %v %q, want 200 with Content-Length: 0", resp.StatusCode, resp.Header, data)
	}
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Errorf("exit = %v, want 0", st)
	}
	if _, err := os.Stat(p.sock); !os.IsNotExist(err) {
		t.Errorf("API socket still there after exit: %v", err)
	}
	// v53 never deletes its lock file.
	if _, err := os.Stat(p.sock + ".lock"); err != nil {
		t.Errorf("lock file: %v", err)
	}
	evs := p.eventsSoFar()
	if len(evs) == 0 || evs[len(evs)-1].String() != "vmm/shutdown" {
		t.Errorf("events = %v, want vmm/shutdown last", evs)
	}
	p.waitEvents("vm/shutdown", "vm/deleted", "vmm/shutdown")
}

func TestCheck14AddDisk(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	extra := filepath.Join(p.dir, "data.img")
	os.WriteFile(extra, []byte("x"), 0o600)
	resp, data := p.do("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, extra))
	if resp.StatusCode != 204 || len(data) != 0 {
		t.Fatalf("cold add-disk = %d %q, want 204", resp.StatusCode, data)
	}
	var info struct {
		Config struct{ Disks []struct{ Path string } }
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if len(info.Config.Disks) != 2 || info.Config.Disks[1].Path != extra {
		t.Fatalf("disks after cold add = %+v", info.Config.Disks)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	hot := filepath.Join(p.dir, "hot.img")
	os.WriteFile(hot, []byte("x"), 0o600)
	data = p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, hot), 200)
	var dev struct{ ID, Bdf string }
	json.Unmarshal(data, &dev)
	if dev.ID != "_disk2" || !strings.HasPrefix(dev.Bdf, "0000:00:") || !strings.HasSuffix(dev.Bdf, ".0") {
		t.Errorf("hot add-disk = %s, want id _disk2 and a bdf 0000:00:0X.0", data)
	}
}

func TestCheck15ResizeCreated(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.resize", `{"desired_vcpus":2}`, 404)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.resize", `{"desired_vcpus":4}`, 204)
	var info struct {
		Config struct {
			Cpus struct {
				BootVcpus int `json:"boot_vcpus"`
			}
		}
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if info.Config.Cpus.BootVcpus != 4 {
		t.Errorf("boot_vcpus = %d, want 4", info.Config.Cpus.BootVcpus)
	}
}

// A balloon resized on a created VM edits the config; on a booted one,
// vm.info's memory_actual_size drops by what the balloon holds (ref:
// docs/ref/cloud-hypervisor.md §3, §5).
func TestCheck15ResizeBalloon(t *testing.T) {
	p := startSim(t)
	cfg := strings.Replace(minimalConfig(t, p.dir), `"console":`, `"balloon":{"size":0,"deflate_on_oom":true},"console":`, 1)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.resize", `{"desired_balloon":268435456}`, 204)
	var info struct {
		Config struct {
			Balloon struct {
				Size         uint64 `json:"size"`
				DeflateOnOom bool   `json:"deflate_on_oom"`
			}
		}
		MemoryActualSize uint64 `json:"memory_actual_size"`
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if info.Config.Balloon.Size != 256<<20 || !info.Config.Balloon.DeflateOnOom || info.MemoryActualSize != 1<<30 {
		t.Errorf("created: balloon %+v, memory_actual_size %d; want 256 MiB in the config, the full 1 GiB actual", info.Config.Balloon, info.MemoryActualSize)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if info.MemoryActualSize != 768<<20 {
		t.Errorf("booted with a 256 MiB balloon: memory_actual_size %d, want %d", info.MemoryActualSize, 768<<20)
	}
	p.wantStatus("PUT", "/api/v1/vm.resize", `{"desired_balloon":0}`, 204)
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if info.MemoryActualSize != 1<<30 || info.Config.Balloon.Size != 0 {
		t.Errorf("deflated: memory_actual_size %d, balloon %d", info.MemoryActualSize, info.Config.Balloon.Size)
	}
}

func TestCheck16Counters(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("GET", "/api/v1/vm.counters", "", 500)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var counters map[string]map[string]uint64
	if err := json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.counters", "", 200), &counters); err != nil {
		t.Fatal(err)
	}
	if _, ok := counters["_disk0"]["read_bytes"]; !ok {
		t.Errorf("counters = %v, want _disk0.read_bytes", counters)
	}
}

func TestCheck17Routing(t *testing.T) {
	p := startSim(t)
	data := p.wantStatus("PUT", "/api/v1/vm.nope", "", 404)
	if got := errorChain(t, data); !reflect.DeepEqual(got, []string{"Not Found"}) {
		t.Errorf("unknown path = %q", got)
	}
	data = p.wantStatus("GET", "/api/v1/vm.boot", "", 400)
	if got := errorChain(t, data); !reflect.DeepEqual(got, []string{"Bad Request"}) {
		t.Errorf("GET vm.boot = %q", got)
	}
	p.wantStatus("PUT", "/api/v1/vm.info", "", 400)
	p.wantStatus("PUT", "/api/v1/vm.create", "", 400)
}

func TestCheck18Headers(t *testing.T) {
	p := startSim(t)
	cfg := minimalConfig(t, p.dir)
	for _, r := range []struct{ method, path, body string }{
		{"GET", "/api/v1/vmm.ping", ""}, {"GET", "/api/v1/vm.info", ""}, {"PUT", "/api/v1/vm.create", cfg},
		{"PUT", "/api/v1/vm.create", cfg}, {"GET", "/api/v1/vm.info", ""}, {"PUT", "/api/v1/vm.boot", ""},
		{"GET", "/api/v1/nope", ""}, {"GET", "/api/v1/vm.boot", ""}, {"PUT", "/api/v1/vm.create", "{"},
	} {
		resp, _ := p.do(r.method, r.path, r.body)
		if got := resp.Header.Get("Server"); got != "Cloud Hypervisor API" {
			t.Errorf("%s %s: Server = %q", r.method, r.path, got)
		}
		if got := resp.Header.Get("Connection"); got != "keep-alive" {
			t.Errorf("%s %s: Connection = %q", r.method, r.path, got)
		}
		ct := resp.Header.Get("Content-Type")
		if resp.StatusCode == 204 && ct != "" || resp.StatusCode != 204 && ct != "application/json" {
			t.Errorf("%s %s: %d with Content-Type %q", r.method, r.path, resp.StatusCode, ct)
		}
	}
}

func TestCheck19EventStream(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.waitEvents("vm/booted")
	data, err := os.ReadFile(p.events)
	if err != nil {
		t.Fatal(err)
	}
	records := strings.Split(strings.TrimSuffix(string(data), "\n\n"), "\n\n")
	if len(records) < 3 {
		t.Fatalf("stream = %q, want at least three blank-line separated events", data)
	}
	for i, rec := range records {
		if !strings.Contains(rec, "\n  ") {
			t.Errorf("event %d is not pretty-printed: %q", i, rec)
		}
		var ev struct {
			Timestamp *struct {
				Secs  *uint64 `json:"secs"`
				Nanos *uint32 `json:"nanos"`
			} `json:"timestamp"`
			Source     *string          `json:"source"`
			Event      *string          `json:"event"`
			Properties *json.RawMessage `json:"properties"`
		}
		dec := json.NewDecoder(strings.NewReader(rec))
		if err := dec.Decode(&ev); err != nil {
			t.Fatalf("event %d %q: %v", i, rec, err)
		}
		var keys map[string]json.RawMessage
		json.Unmarshal([]byte(rec), &keys)
		if _, ok := keys["properties"]; !ok || ev.Timestamp == nil || ev.Timestamp.Secs == nil || ev.Timestamp.Nanos == nil || ev.Source == nil || ev.Event == nil {
			t.Errorf("event %d %q lacks a field", i, rec)
		}
		if ev.Properties != nil && string(*ev.Properties) != "null" {
			var props map[string]string
			if err := json.Unmarshal(*ev.Properties, &props); err != nil {
				t.Errorf("event %d properties %s: %v", i, *ev.Properties, err)
			}
		}
	}
	if !strings.Contains(records[0], `"source": "vmm"`) || !strings.Contains(records[0], `"event": "starting"`) {
		t.Errorf("first event = %q, want vmm starting", records[0])
	}
}

func vsockConfig(t testing.TB, p *simProc) (string, string) {
	sock := filepath.Join(p.dir, "vsock.sock")
	cfg := minimalConfig(t, p.dir)
	cfg = strings.TrimSuffix(cfg, "}") + fmt.Sprintf(`,"vsock":{"cid":3,"socket":%q}}`, sock)
	return cfg, sock
}

func TestCheck20Vsock(t *testing.T) {
	p := startSim(t, "--sim-guest-ports", "1024")
	cfg, sock := vsockConfig(t, p)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("vsock socket exists before boot: %v", err)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)

	t.Run("listening port", func(t *testing.T) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		// The payload follows the command in the same write: CH must not swallow it.
		io.WriteString(c, "CONNECT 1024\nhello")
		br := bufio.NewReader(c)
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		var n uint64
		if _, err := fmt.Sscanf(line, "OK %d\n", &n); err != nil || n < 1<<30 || line != fmt.Sprintf("OK %d\n", n) {
			t.Fatalf("answer = %q, want \"OK n\" with n ≥ 2^30", line)
		}
		echo := make([]byte, 5)
		if _, err := io.ReadFull(br, echo); err != nil || string(echo) != "hello" {
			t.Fatalf("echo = %q, %v; want the bytes after the command to reach the guest", echo, err)
		}
	})
	t.Run("closed port", func(t *testing.T) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, "connect 2000\n")
		data, err := io.ReadAll(c)
		if err != nil || len(data) != 0 {
			t.Fatalf("closed port read %q, %v; want EOF and nothing else", data, err)
		}
	})
	t.Run("guest connects", func(t *testing.T) {
		l, err := net.Listen("unix", sock+"_5000")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		p.wantStatus("PUT", "/sim/v1/vsock/connect", `{"port":5000,"data":"ping"}`, 204)
		l.(*net.UnixListener).SetDeadline(time.Now().Add(5 * time.Second))
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		got := make([]byte, 4)
		if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
			t.Fatalf("host listener read %q, %v", got, err)
		}
		// Without a host listener the guest is refused.
		p.wantStatus("PUT", "/sim/v1/vsock/connect", `{"port":5001}`, 409)
	})

	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("vsock socket left after shutdown: %v", err)
	}
}

var _ = syscall.SIGTERM
