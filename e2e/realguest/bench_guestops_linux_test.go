package realguest

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestRealGuestBench measures vmhost's guest operations in real guests
// beside what a user would otherwise reach for, SSH (only with
// VMHOST_LANE_BENCH=1; bench/guest-ops.sh runs it):
//
//   - the round trip of `true`: `vmhost appvm exec` (the client process,
//     as a user runs it) and the bare API request, in an AppVM; `ssh` with
//     a new connection and over a multiplexed one (ControlMaster), in a
//     classic Debian guest;
//   - 100 MiB copied in and out: `vmhost appvm cp` to and from the AppVM,
//     `scp` to and from the Debian guest.
//
// An AppVM has no sshd, so the SSH side runs in the lane's classic guest:
// the same kernel, qemu and host, one vCPU each, both guests up at once.
// The sides alternate, their order rotating each round; the medians are
// printed. VMHOST_LANE_BENCH_ROUNDS sets the exec rounds (default 15; the
// copies take a third as many, at least 3).
func TestRealGuestBench(t *testing.T) {
	if os.Getenv("VMHOST_LANE_BENCH") != "1" {
		t.Skip("the guest operations benchmark runs with VMHOST_LANE_BENCH=1 (bench/guest-ops.sh)")
	}
	rounds := 15
	if n, err := strconv.Atoi(os.Getenv("VMHOST_LANE_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	a := findArtifacts(t)
	l := setUp(t, a)
	importImage(l)

	// The classic guest, with sshd.
	req := map[string]any{
		"vm_id": "bench-ssh", "vcpus": 1, "memory_mb": 768, "firmware_path": ovmf,
		"disk": map[string]any{"base_path": a.image, "size_gib": 4},
		"nets": []any{map[string]any{"network_id": "lane"}},
		"cloud_init": map[string]any{"hostname": "bench-ssh", "user": "lane", "ssh_authorized_keys": []string{l.sshPub},
			"network": map[string]any{"ipv4": map[string]any{"address": staticIP + "/24", "gateway": hostIP}}},
		"auto_boot": true,
	}
	body, _ := json.Marshal(req)
	l.must("POST", "/api/vms", string(body), http.StatusCreated)
	// The AppVM.
	// The copies land on a data volume: the root file system is the
	// image's size.
	app := map[string]any{"vm_id": "bench-app", "image_id": "busybox", "vcpus": 1, "memory_mb": 768, "disk_gib": 1,
		"network_id": "lane", "command": []string{"/bin/sh", "-c", "while :; do sleep 1; done"},
		"data_volumes": []any{map[string]any{"size_gib": 1, "mountpoint": "/data"}}}
	body, _ = json.Marshal(app)
	l.must("POST", "/api/appvm/vms", string(body), http.StatusCreated)
	l.waitSSH("lane", staticIP, bootTimeout)
	l.poll("an exec in the AppVM", appvmTimeout, func() bool {
		_, _, code := l.cli("", "appvm", "exec", "bench-app", "--", "true")
		return code == 0
	})
	ctl := filepath.Join(l.dir, "ssh-ctl")
	sshArgs := []string{"-i", l.sshKey, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"}
	inNS := func(args ...string) error {
		out, err := exec.Command("ip", append([]string{"netns", "exec", l.ns}, args...)...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%q: %v %s", args, err, out)
		}
		return nil
	}
	if err := inNS(append(append([]string{"ssh"}, sshArgs...), "-M", "-S", ctl, "-N", "-f", "lane@"+staticIP)...); err != nil {
		t.Fatal(err)
	}
	defer inNS("ssh", "-S", ctl, "-O", "exit", "lane@"+staticIP)

	type side struct {
		name string
		run  func() error
	}
	measure := func(sides []side, n int) map[string][]time.Duration {
		times := map[string][]time.Duration{}
		for r := range n {
			for i := range sides {
				s := sides[(i+r)%len(sides)]
				start := time.Now()
				if err := s.run(); err != nil {
					t.Fatalf("%s: %v", s.name, err)
				}
				times[s.name] = append(times[s.name], time.Since(start))
			}
		}
		return times
	}
	cliOK := func(args ...string) error {
		if out, errOut, code := l.cli("", args...); code != 0 {
			return fmt.Errorf("vmhost %q = %d %s %s", args, code, out, errOut)
		}
		return nil
	}
	execSides := []side{
		{"vmhost appvm exec (client)", func() error { return cliOK("appvm", "exec", "bench-app", "--", "true") }},
		{"vmhost exec (API request)", func() error {
			if st, b := l.do("POST", "/api/appvm/vms/bench-app/exec", `{"command":["true"]}`); st != http.StatusOK {
				return fmt.Errorf("%d %s", st, b)
			}
			return nil
		}},
		{"ssh (new connection)", func() error {
			return inNS(append(append([]string{"ssh"}, sshArgs...), "lane@"+staticIP, "true")...)
		}},
		{"ssh (multiplexed)", func() error {
			return inNS(append(append([]string{"ssh"}, sshArgs...), "-S", ctl, "lane@"+staticIP, "true")...)
		}},
	}
	execTimes := measure(execSides, rounds)

	blob := make([]byte, 100<<20)
	rand.Read(blob)
	src := filepath.Join(l.dir, "blob")
	if err := os.WriteFile(src, blob, 0o644); err != nil {
		t.Fatal(err)
	}
	outVMHost, outSCP := filepath.Join(l.dir, "out-vmhost"), filepath.Join(l.dir, "out-scp")
	os.Mkdir(outVMHost, 0o755)
	os.Mkdir(outSCP, 0o755)
	copySides := []side{
		{"vmhost appvm cp in", func() error { return cliOK("appvm", "cp", src, "bench-app:/data") }},
		{"scp in", func() error {
			return inNS(append(append([]string{"scp", "-q"}, sshArgs...), src, "lane@"+staticIP+":/tmp/")...)
		}},
		{"vmhost appvm cp out", func() error { return cliOK("appvm", "cp", "bench-app:/data/blob", outVMHost) }},
		{"scp out", func() error {
			return inNS(append(append([]string{"scp", "-q"}, sshArgs...), "lane@"+staticIP+":/tmp/blob", outSCP+"/")...)
		}},
	}
	// In before out: the first round's outs need the ins.
	for _, s := range copySides[:2] {
		if err := s.run(); err != nil {
			t.Fatal(err)
		}
	}
	copyTimes := measure(copySides, max(3, rounds/3))
	for _, p := range []string{outVMHost, outSCP} {
		if got, err := os.ReadFile(filepath.Join(p, "blob")); err != nil || !bytes.Equal(got, blob) {
			t.Errorf("%s: the copy out differs from what went in (%v)", p, err)
		}
	}

	var report strings.Builder
	fmt.Fprintf(&report, "guest operations, real guests (qemu), %d exec rounds, %d copy rounds, medians:\n", rounds, max(3, rounds/3))
	row := func(name string, d []time.Duration, mib float64) {
		slices.Sort(d)
		med := d[len(d)/2]
		fmt.Fprintf(&report, "  %-28s %9.1f ms  (min %7.1f, max %7.1f)", name, ms(med), ms(d[0]), ms(d[len(d)-1]))
		if mib > 0 {
			fmt.Fprintf(&report, "  %6.1f MiB/s", mib/med.Seconds())
		}
		report.WriteString("\n")
	}
	for _, s := range execSides {
		row(s.name, execTimes[s.name], 0)
	}
	for _, s := range copySides {
		row(s.name, copyTimes[s.name], 100)
	}
	t.Log("\n" + report.String())
	fmt.Print(report.String())
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
