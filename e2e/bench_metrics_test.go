//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"testing"

	"vmhost/chclient"
	"vmhost/config"
)

// BenchmarkMetricsScrape measures GET /metrics of an agent with
// VMHOST_BENCH_VMS running VMs (default 100; the figure is 1000)
// in sim mode, beside what a script would otherwise do for the same
// counters: read vm.counters from each VM's CH socket one after the other
// ("direct"), and beside GET /api/vms, the list a control plane polls.
// bytes/scrape is the exposition's size.
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
		for range b.N {
			st, out := s.do("GET", "/metrics", "")
			if st != http.StatusOK {
				b.Fatalf("GET /metrics = %d", st)
			}
			size = len(out)
		}
		b.ReportMetric(float64(size), "bytes/scrape")
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
