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
// with the simulators ("vmhost"), beside "children": the same child-process
// work (the VM's directory, root disk copy, data volume, qemu-storage-daemon
// and CH launch, vm.create, vm.boot) for 100 VMs from 10 goroutines
// without vmhost. Each
// iteration runs both, in alternating order, so the drift of a busy
// machine (and of a file system whose inode allocation slows down after
// many deletes) weighs on both sides alike. Reported, as medians over the
// iterations: the wall time of the 100 on each side, the p50 and p90 of
// one create on each side, share-ms/create (vmhost's wall time minus the
// children's, per create: the agent's own share), and the agent's own CPU
// time per create (the simulators are other processes).
//
//	go test ./e2e -run '^$' -bench CreateConcurrent -benchtime 5x
func BenchmarkCreateConcurrent(b *testing.B) {
	const total, clients = 100, 10
	run := func(one func(i int)) (time.Duration, []time.Duration) {
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
		slices.Sort(lat)
		return time.Since(start), lat
	}
	f := newFixture(b)
	type side struct{ wall, p50, p90, cpu []time.Duration }
	var agent, direct side
	record := func(s *side, wall time.Duration, lat []time.Duration) {
		s.wall = append(s.wall, wall)
		s.p50 = append(s.p50, lat[len(lat)/2])
		s.p90 = append(s.p90, lat[len(lat)*9/10])
	}
	viaAgent := func(n int) {
		s := startServer(b, serverOpts{edit: func(c *config.Config) { c.HostCPUs, c.HostMemoryMB = 4*total, total*256 }})
		defer s.stop()
		cpu := procCPU(b, s.cmd.Process.Pid)
		wall, lat := run(func(i int) {
			if st, out := s.do("POST", "/api/vms", f.body(fmt.Sprintf("c%d-%03d", n, i), true, "")); st != http.StatusCreated {
				b.Errorf("create: %d %s", st, out)
			}
		})
		agent.cpu = append(agent.cpu, (procCPU(b, s.cmd.Process.Pid)-cpu)/total)
		record(&agent, wall, lat)
	}
	withoutAgent := func() {
		dirs := make([]string, total)
		defer func() {
			for _, dir := range dirs {
				if dir != "" {
					os.RemoveAll(dir)
				}
			}
		}()
		stops := make([]func(), total)
		wall, lat := run(func(i int) {
			// The files vmhost would have made, timed here too: the VM's
			// directory, the sparse copy and the data volume are part of
			// a create.
			dir, err := os.MkdirTemp(shortTemp(), "vhb")
			if err != nil {
				b.Error(err)
				return
			}
			dirs[i] = dir
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
		record(&direct, wall, lat)
	}
	b.ResetTimer()
	for n := range b.N {
		if n%2 == 0 {
			viaAgent(n)
			withoutAgent()
		} else {
			withoutAgent()
			viaAgent(n)
		}
	}
	b.StopTimer()
	median := func(d []time.Duration) float64 {
		d = slices.Clone(d)
		slices.Sort(d)
		return float64(d[len(d)/2].Microseconds()) / 1000
	}
	share := make([]time.Duration, b.N)
	for i := range share {
		share[i] = (agent.wall[i] - direct.wall[i]) / total
	}
	b.ReportMetric(median(agent.wall), "vmhost-ms/100creates")
	b.ReportMetric(median(direct.wall), "children-ms/100creates")
	b.ReportMetric(median(share), "share-ms/create")
	b.ReportMetric(median(agent.p50), "vmhost-p50-ms")
	b.ReportMetric(median(agent.p90), "vmhost-p90-ms")
	b.ReportMetric(median(direct.p50), "children-p50-ms")
	b.ReportMetric(median(direct.p90), "children-p90-ms")
	b.ReportMetric(median(agent.cpu), "agent-cpu-ms/create")
}
