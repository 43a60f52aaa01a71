package api

import (
	"context"
	"net/http"
	"sort"
	"sync"
	"time"

	"vmhost/metrics"
	"vmhost/vm"
)

// GET /metrics (docs/api.md, Metrics): the Prometheus text exposition of every
// VM's state, device counters, restarts and heartbeat age, the host's VMs
// by state, admission capacity and image cache, and the agent's own
// process metrics.
//
// Counters come from each running VM's Cloud Hypervisor, read in parallel
// (at most scrapeWorkers at once) under one deadline, scrapeBudget, for the
// whole scrape: a VM that has not answered by then is left out and counted
// in vmhost_scrape_errors_total, so one hung VMM never stalls the scrape.
const (
	scrapeBudget  = 2 * time.Second
	scrapeWorkers = 64
)

// counterNames maps CH's vm.counters names to the metrics' (without the
// vmhost_vm_ prefix and _total suffix), per device kind.
var counterNames = map[string]string{
	"read_bytes":  "block_read_bytes",
	"write_bytes": "block_write_bytes",
	"read_ops":    "block_read_ops",
	"write_ops":   "block_write_ops",
	"rx_bytes":    "net_rx_bytes",
	"tx_bytes":    "net_tx_bytes",
	"rx_frames":   "net_rx_frames",
	"tx_frames":   "net_tx_frames",
}

var counterHelp = map[string]string{
	"block_read_bytes":  "Bytes read by the guest from the block device.",
	"block_write_bytes": "Bytes written by the guest to the block device.",
	"block_read_ops":    "Read requests of the guest to the block device.",
	"block_write_ops":   "Write requests of the guest to the block device.",
	"net_rx_bytes":      "Bytes the guest received on the network device.",
	"net_tx_bytes":      "Bytes the guest sent on the network device.",
	"net_rx_frames":     "Frames the guest received on the network device.",
	"net_tx_frames":     "Frames the guest sent on the network device.",
}

// scrapeState is what the metrics keep between scrapes.
type scrapeState struct {
	errors sync.Mutex
	// errorsTotal counts VMs whose counters could not be read, across
	// scrapes.
	errorsTotal uint64
}

// vmCounters is one VM's counters as read for a scrape.
type vmCounters struct {
	rec      *vm.Record
	counters map[string]map[string]uint64
}

// readCounters reads the counters of every running or paused VM in
// parallel within scrapeBudget and returns those that answered, and how
// many did not.
func (s *Server) readCounters(ctx context.Context, recs []*vm.Record) (got []vmCounters, failed int) {
	ctx, cancel := context.WithTimeout(ctx, scrapeBudget)
	defer cancel()
	var up []*vm.Record
	for _, r := range recs {
		if r.State == vm.StateRunning || r.State == vm.StatePaused {
			up = append(up, r)
		}
	}
	results := make([]vmCounters, len(up))
	var wg sync.WaitGroup
	next := make(chan int)
	for range min(scrapeWorkers, len(up)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				c, err := s.vms.Counters(ctx, up[i])
				if err == nil {
					results[i] = vmCounters{up[i], c}
				}
			}
		}()
	}
	for i := range up {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, r := range results {
		if r.rec == nil {
			failed++
			continue
		}
		got = append(got, r)
	}
	return got, failed
}

// metrics answers GET /metrics.
func (s *Server) metrics(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	recs := append(s.vms.List(vm.ModeVM), s.vms.List(vm.ModeAppVM)...)
	counters, failed := s.readCounters(r.Context(), recs)
	s.scrape.errors.Lock()
	s.scrape.errorsTotal += uint64(failed)
	errorsTotal := s.scrape.errorsTotal
	s.scrape.errors.Unlock()

	var m metrics.Writer
	m.Family("vmhost_vm_state", metrics.Gauge, "The VM's state: 1 for the state it is in.")
	byState := map[[2]string]int{}
	for _, rec := range recs {
		m.Sample("vmhost_vm_state", 1, "vm_id", rec.ID, "mode", string(rec.Mode), "state", string(rec.State))
		byState[[2]string{string(rec.Mode), string(rec.State)}]++
	}
	s.writeCounters(&m, counters)
	s.writeUsage(&m, recs)
	m.Family("vmhost_vm_restarts", metrics.Gauge, "Consecutive automatic restarts of the AppVM (reset after a stable period).")
	for _, rec := range recs {
		if rec.AppVM != nil && rec.AppVM.Guest != nil {
			m.Sample("vmhost_vm_restarts", float64(rec.AppVM.Guest.RestartCount), "vm_id", rec.ID, "mode", string(rec.Mode))
		}
	}
	m.Family("vmhost_vm_heartbeat_age_seconds", metrics.Gauge, "Seconds since the AppVM's guest agent last sent a heartbeat.")
	now := time.Now()
	for _, rec := range recs {
		if at, _ := s.apps.LastHeartbeat(rec); !at.IsZero() {
			m.Sample("vmhost_vm_heartbeat_age_seconds", now.Sub(at).Seconds(), "vm_id", rec.ID, "mode", string(rec.Mode))
		}
	}

	m.Family("vmhost_vms", metrics.Gauge, "VMs on the host by family and state.")
	for _, mode := range []vm.Mode{vm.ModeVM, vm.ModeAppVM} {
		for _, st := range []vm.State{vm.StateCreated, vm.StateRunning, vm.StatePaused, vm.StateStopped, vm.StateFailed} {
			m.Sample("vmhost_vms", float64(byState[[2]string{string(mode), string(st)}]), "mode", string(mode), "state", string(st))
		}
	}
	if c, err := s.vms.Capacity(); err == nil {
		m.Family("vmhost_admission_vcpus", metrics.Gauge, "vCPUs VMs may hold: host CPUs times the CPU overcommit.")
		m.Sample("vmhost_admission_vcpus", float64(c.VCPUs))
		m.Family("vmhost_admission_vcpus_used", metrics.Gauge, "vCPUs held by VMs that are neither stopped nor failed.")
		m.Sample("vmhost_admission_vcpus_used", float64(c.VCPUsUsed))
		m.Family("vmhost_admission_memory_bytes", metrics.Gauge, "Memory VMs may hold: host memory times the memory overcommit.")
		m.Sample("vmhost_admission_memory_bytes", float64(c.MemoryMB<<20))
		m.Family("vmhost_admission_memory_used_bytes", metrics.Gauge, "Memory held by VMs that are neither stopped nor failed.")
		m.Sample("vmhost_admission_memory_used_bytes", float64(c.MemoryMBUsed<<20))
	}
	if s.cache != nil {
		if ents, err := s.cache.List(); err == nil {
			var bytes int64
			for _, e := range ents {
				bytes += e.SizeBytes
			}
			m.Family("vmhost_image_cache_bytes", metrics.Gauge, "Bytes of verified images in the image cache.")
			m.Sample("vmhost_image_cache_bytes", float64(bytes))
			m.Family("vmhost_image_cache_images", metrics.Gauge, "Images in the image cache.")
			m.Sample("vmhost_image_cache_images", float64(len(ents)))
		}
	}
	m.Family("vmhost_scrape_errors_total", metrics.Counter, "VMs whose counters could not be read in time for a scrape.")
	m.Sample("vmhost_scrape_errors_total", float64(errorsTotal))
	m.Family("vmhost_scrape_duration_seconds", metrics.Gauge, "How long the VM part of this scrape took.")
	m.Sample("vmhost_scrape_duration_seconds", time.Since(start).Seconds())
	metrics.WriteProcess(&m)

	w.Header().Set("Content-Type", metrics.ContentType)
	w.Write(m.Bytes())
}

// writeUsage writes what each confined VM's processes use, read from its
// cgroup (a few small files per VM; no process is asked).
func (s *Server) writeUsage(m *metrics.Writer, recs []*vm.Record) {
	type usage struct {
		rec *vm.Record
		u   *vm.Usage
	}
	var us []usage
	for _, rec := range recs {
		if u, err := s.vms.Usage(rec); err == nil && u != nil {
			us = append(us, usage{rec, u})
		}
	}
	sort.Slice(us, func(i, j int) bool { return us[i].rec.ID < us[j].rec.ID })
	for _, f := range []struct {
		name, help string
		typ        string
		value      func(*vm.Usage) float64
	}{
		{"vmhost_vm_cpu_seconds_total", "CPU time used by the VM's processes (Cloud Hypervisor, qemu-storage-daemon), from its cgroup.", metrics.Counter,
			func(u *vm.Usage) float64 { return u.CPUSeconds }},
		{"vmhost_vm_memory_bytes", "Memory charged to the VM's cgroup: the guest memory its processes touched and their own.", metrics.Gauge,
			func(u *vm.Usage) float64 { return float64(u.MemoryBytes) }},
		{"vmhost_vm_pids", "Tasks (processes and threads) in the VM's cgroup.", metrics.Gauge,
			func(u *vm.Usage) float64 { return float64(u.Pids) }},
	} {
		m.Family(f.name, f.typ, f.help)
		for _, x := range us {
			m.Sample(f.name, f.value(x.u), "vm_id", x.rec.ID, "mode", string(x.rec.Mode))
		}
	}
}

// writeCounters writes the counter families, one family at a time across
// every VM (the format wants a family's samples together).
func (s *Server) writeCounters(m *metrics.Writer, vms []vmCounters) {
	type sample struct {
		vm     *vm.Record
		device string
		value  uint64
	}
	families := map[string][]sample{}
	for _, v := range vms {
		for dev, cs := range v.counters {
			for name, val := range cs {
				if metric, ok := counterNames[name]; ok {
					families[metric] = append(families[metric], sample{v.rec, dev, val})
				}
			}
		}
	}
	names := make([]string, 0, len(counterNames))
	for _, n := range counterNames {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, metric := range names {
		full := "vmhost_vm_" + metric + "_total"
		m.Family(full, metrics.Counter, counterHelp[metric])
		ss := families[metric]
		sort.Slice(ss, func(i, j int) bool {
			if ss[i].vm.ID != ss[j].vm.ID {
				return ss[i].vm.ID < ss[j].vm.ID
			}
			return ss[i].device < ss[j].device
		})
		for _, x := range ss {
			m.Sample(full, float64(x.value), "vm_id", x.vm.ID, "mode", string(x.vm.Mode), "device", x.device)
		}
	}
}
