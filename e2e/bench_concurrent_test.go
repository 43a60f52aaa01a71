//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/qcow2"
)

// BenchmarkCreateConcurrent: 100 creates with auto_boot (2 GiB root copy,
// one data volume) from 10 concurrent clients through the real server
// with the simulators, beside "children": the same child-process work
// (qemu-storage-daemon and CH launch, vm.create, vm.boot) for 100 VMs
// from 10 goroutines without vmhost. Reported: wall time of the 100, and
// the p50 and p90 of one request.
//
//	go test ./e2e -run '^$' -bench CreateConcurrent -benchtime 1x
func BenchmarkCreateConcurrent(b *testing.B) {
	const total, clients = 100, 10
	report := func(b *testing.B, wall time.Duration, lat []time.Duration) {
		slices.Sort(lat)
		b.ReportMetric(float64(wall.Milliseconds()), "ms/100creates")
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
		b.ReportMetric(float64(lat[len(lat)*9/10].Microseconds())/1000, "p90-ms")
	}
	run := func(b *testing.B, one func(i int)) (time.Duration, []time.Duration) {
		lat := make([]time.Duration, total)
		next := make(chan int)
		var wg sync.WaitGroup
		start := time.Now()
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range next {
					t := time.Now()
					one(i)
					lat[i] = time.Since(t)
				}
			}()
		}
		for i := range total {
			next <- i
		}
		close(next)
		wg.Wait()
		return time.Since(start), lat
	}
	b.Run("vmhost", func(b *testing.B) {
		for n := range b.N {
			b.StopTimer()
			s := startServer(b, serverOpts{edit: func(c *config.Config) { c.HostCPUs, c.HostMemoryMB = 4*total, total*256 }})
			f := newFixture(b)
			b.StartTimer()
			wall, lat := run(b, func(i int) {
				if st, out := s.do("POST", "/api/vms", f.body(fmt.Sprintf("c%d-%03d", n, i), true, "")); st != http.StatusCreated {
					b.Errorf("create: %d %s", st, out)
				}
			})
			b.StopTimer()
			report(b, wall, lat)
			s.stop()
			b.StartTimer()
		}
	})
	b.Run("children", func(b *testing.B) {
		f := newFixture(b)
		for range b.N {
			dirs := make([]string, total)
			for i := range dirs {
				dir, err := os.MkdirTemp("/tmp", "vhb")
				if err != nil {
					b.Fatal(err)
				}
				defer os.RemoveAll(dir)
				dirs[i] = dir
			}
			stops := make([]func(), total)
			wall, lat := run(b, func(i int) {
				dir := dirs[i]
				// The files vmhost would have made, timed here too: the
				// sparse copy and the data volume are part of a create.
				if err := exec.Command("cp", "--sparse=always", f.base, dir+"/root.qcow2").Run(); err != nil {
					b.Error(err)
					return
				}
				if err := qcow2.Create(dir+"/data0.qcow2", 1<<30); err != nil {
					b.Error(err)
					return
				}
				stop, err := launchChildren(dir, f.kernel, simBin, []string{"sim-qsd"})
				if err != nil {
					b.Error(err)
					return
				}
				stops[i] = stop
			})
			for _, stop := range stops {
				if stop != nil {
					stop()
				}
			}
			report(b, wall, lat)
		}
	})
}
