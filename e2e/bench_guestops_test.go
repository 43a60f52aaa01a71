//go:build linux

package e2e

import (
	"net/http"
	"os/exec"
	"slices"
	"testing"
	"time"
)

// BenchmarkGuestExec measures the round trip of an exec of `true` in an
// AppVM of the simulator (its guest agent a process on this host), through
// the real agent: the API request alone and the client (`vmhost appvm
// exec`, a process as a user runs it), beside the floor, the same `true`
// forked and executed here directly. The three alternate, their order
// rotating each iteration; the medians are reported (ms/…). What remains
// above the floor is vmhost's: HTTP, the hybrid vsock connection through
// the simulator, the guest agent's frames, the redaction.
func BenchmarkGuestExec(b *testing.B) {
	s := startAppVMServer(b, map[string]string{"idle": "exec sleep 3600"})
	if st, body := s.do("POST", "/api/appvm/vms", `{"vm_id":"bench","image_id":"idle","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.11","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		b.Fatalf("create = %d %s", st, body)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if st, _ := s.do("POST", "/api/appvm/vms/bench/exec", `{"command":["true"]}`); st == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("no exec answered within 30 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	truePath, err := exec.LookPath("true")
	if err != nil {
		b.Fatal(err)
	}
	sides := []struct {
		name string
		run  func() error
	}{
		{"api", func() error {
			if st, body := s.do("POST", "/api/appvm/vms/bench/exec", `{"command":["true"]}`); st != http.StatusOK {
				b.Fatalf("exec = %d %s", st, body)
			}
			return nil
		}},
		{"client", func() error {
			cmd := exec.Command(vmhostBin, "appvm", "exec", "bench", "--", "true")
			cmd.Env = []string{"VMHOST_API=unix:" + s.sock, "VMHOST_TOKEN=" + s.token}
			return cmd.Run()
		}},
		{"fork-exec", func() error { return exec.Command(truePath).Run() }},
	}
	times := make([][]time.Duration, len(sides))
	b.ResetTimer()
	for i := range b.N {
		for j := range sides {
			k := (i + j) % len(sides)
			start := time.Now()
			if err := sides[k].run(); err != nil {
				b.Fatalf("%s: %v", sides[k].name, err)
			}
			times[k] = append(times[k], time.Since(start))
		}
	}
	b.StopTimer()
	for k, s := range sides {
		slices.Sort(times[k])
		b.ReportMetric(float64(times[k][len(times[k])/2].Microseconds())/1000, "ms/"+s.name)
	}
}
