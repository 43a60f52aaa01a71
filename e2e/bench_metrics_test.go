//go:build linux

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/config"
)

// procCPU is the CPU time (user and system) process pid has used.
func procCPU(b *testing.B, pid int) time.Duration {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:]))
	ut, _ := strconv.Atoi(f[11])
	stime, _ := strconv.Atoi(f[12])
	return time.Duration(ut+stime) * 10 * time.Millisecond // USER_HZ 100
}

// BenchmarkMetricsScrape measures GET /metrics of an agent with
// VMHOST_BENCH_VMS running VMs (default 100; the figure is 1000)
// in sim mode, beside what a script would otherwise do for the same
// counters: read vm.counters from each VM's CH socket one after the other
// ("direct"), and beside GET /api/vms, the list a control plane polls.
// bytes/scrape is the exposition's size, agent-cpu-ms/scrape the agent's
// own CPU time per scrape (the simulators answering are other processes).
//
//	VMHOST_BENCH_VMS=1000 go test ./e2e -run '^$' -bench MetricsScrape -benchtime 20x
func BenchmarkMetricsScrape(b *testing.B) {
	n := 100
	if v, err := strconv.Atoi(os.Getenv("VMHOST_BENCH_VMS")); err == nil && v > 0 {
		n = v
	}
	s := startServer(b, serverOpts{edit: func(c *config.Config) {
		c.HostCPUs, c.HostMemoryMB = n, n*256
	}})
	f := newFixture(b)
	for i := range n {
		body := fmt.Sprintf(`{"vm_id":"m%04d","vcpus":1,"memory_mb":64,"kernel_path":%q,"disk":{"base_path":%q},"auto_boot":true}`, i, f.kernel, f.base)
		if st, out := s.do("POST", "/api/vms", body); st != http.StatusCreated {
			b.Fatalf("create %d: %d %s", i, st, out)
		}
	}
	b.Run(fmt.Sprintf("vms=%d/metrics", n), func(b *testing.B) {
		var size int
		cpu0 := procCPU(b, s.cmd.Process.Pid)
		for range b.N {
			st, out := s.do("GET", "/metrics", "")
			if st != http.StatusOK {
				b.Fatalf("GET /metrics = %d", st)
			}
			size = len(out)
		}
		b.ReportMetric(float64(size), "bytes/scrape")
		b.ReportMetric(float64((procCPU(b, s.cmd.Process.Pid)-cpu0).Microseconds())/1000/float64(b.N), "agent-cpu-ms/scrape")
	})
	b.Run(fmt.Sprintf("vms=%d/direct", n), func(b *testing.B) {
		ctx := context.Background()
		for range b.N {
			for i := range n {
				c := chclient.New(fmt.Sprintf("%s/vms/m%04d/ch.sock", s.runDir, i))
				if _, err := c.Counters(ctx); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		}
	})
	b.Run(fmt.Sprintf("vms=%d/list", n), func(b *testing.B) {
		for range b.N {
			if st, _ := s.do("GET", "/api/vms", ""); st != http.StatusOK {
				b.Fatalf("GET /api/vms = %d", st)
			}
		}
	})
}
