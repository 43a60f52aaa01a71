//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"os/exec"
	"slices"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/internal/netnstest"
)

// BenchmarkCreateJail measures what confinement adds to a create with
// auto_boot (POST /api/vms to 201: root disk copy, data volume, storage
// daemon, Cloud Hypervisor, boot) through the real server: two agents, one
// confining its VMs (as root, the default) and one with jail.enabled
// false, take turns in one loop (the one going first alternates) and the
// medians are reported in ms per create, with their difference, the jail's
// cost per create. Variants: the simulators for both programs, and the
// real qemu-storage-daemon (a dynamic program, 21 library binds) where
// installed. Each VM is deleted outside the timer.
//
//	go test ./e2e -run '^$' -bench CreateJail -benchtime 40x
func BenchmarkCreateJail(b *testing.B) {
	netnstest.RequireRoot(b)
	variants := []struct{ name, simulate, qsd string }{{"sim", "ch,qsd", ""}}
	if p, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		variants = append(variants, struct{ name, simulate, qsd string }{"realqsd", "ch", p})
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			start := func(jail bool) *server {
				return startServer(b, serverOpts{simulate: v.simulate, edit: func(c *config.Config) {
					c.Jail.Enabled = new(jail)
					if v.qsd != "" {
						c.Binaries.QemuStorageDaemon = v.qsd
					}
				}})
			}
			sides := []*server{start(true), start(false)}
			f := newFixture(b)
			create := func(s *server, id string) time.Duration {
				t0 := time.Now()
				if st, body := s.do("POST", "/api/vms", f.body(id, true, "")); st != http.StatusCreated {
					b.Fatalf("POST = %d %s", st, body)
				}
				d := time.Since(t0)
				if st, body := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
					b.Fatalf("DELETE = %d %s", st, body)
				}
				return d
			}
			create(sides[0], "warm")
			create(sides[1], "warm")
			times := [2][]time.Duration{}
			b.ResetTimer()
			for i := range b.N {
				for k := range 2 {
					side := (i + k) % 2
					times[side] = append(times[side], create(sides[side], fmt.Sprintf("b%d", i)))
				}
			}
			b.StopTimer()
			jailed, plain := medianOf(times[0]), medianOf(times[1])
			b.ReportMetric(ms(jailed), "jailed-ms/create")
			b.ReportMetric(ms(plain), "unconfined-ms/create")
			b.ReportMetric(ms(jailed-plain), "jail-ms/create")
		})
	}
}

func medianOf(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
