package engine

import (
	"errors"
	"io/fs"
	"net"
	"sync"
	"time"

	"vmhost/tap"
	"vmhost/vm/record"
)

// defaultFactsInterval is how often a running VM's neighbour-table address
// is read.
const defaultFactsInterval = 5 * time.Second

// facts gathers the guest facts of a watched VM until the monitor ends:
// one DHCP follower per interface without a static IPv4, and a poll of the
// neighbour table for every interface.
func (m *monitor) facts() {
	h := m.e.o.Taps
	rec := m.e.recs.Get(m.id)
	if h == nil || rec == nil || len(rec.NICs) == 0 {
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	for i, nic := range rec.NICs {
		mac, err := net.ParseMAC(nic.MAC)
		if err != nil || staticIPv4(rec, i) {
			continue
		}
		guard := m.e.dhcpGuard(rec, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := h.FollowDHCP(m.ctx, nic.Tap, mac, guard, func(b tap.Binding) {
				ip := b.IP.String()
				m.e.log.Info("guest address from DHCP", "id", m.id, "tap", nic.Tap, "ipv4", ip)
				m.update(func(r *record.Record) func(*record.Record) {
					if i >= len(r.NICs) || r.NICs[i].DHCPSnoopedIPv4 == ip {
						return nil
					}
					return func(r *record.Record) { r.NICs[i].DHCPSnoopedIPv4 = ip }
				})
			})
			if err != nil && m.ctx.Err() == nil {
				m.e.log.Warn("DHCP snooping stopped; dhcp_snooped_ipv4 will not follow the guest", "id", m.id, "tap", nic.Tap, "err", err)
			}
		}()
	}
	every := m.e.mon.factsEvery
	if every <= 0 {
		every = defaultFactsInterval
	}
	t := time.NewTicker(every)
	defer t.Stop()
	warned := false
	for {
		for i, nic := range rec.NICs {
			mac, err := net.ParseMAC(nic.MAC)
			if err != nil {
				continue
			}
			addr, err := h.LastIPv4(m.ctx, mac)
			if err != nil {
				if !errors.Is(err, fs.ErrNotExist) && m.ctx.Err() == nil && !warned {
					warned = true
					m.e.log.Warn("reading the neighbour table", "id", m.id, "err", err)
				}
				continue
			}
			ip := addr.String()
			m.update(func(r *record.Record) func(*record.Record) {
				if i >= len(r.NICs) || r.NICs[i].LastObservedIPv4 == ip {
					return nil
				}
				return func(r *record.Record) { r.NICs[i].LastObservedIPv4 = ip }
			})
		}
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// staticIPv4 reports whether interface i of rec has a static IPv4: its
// own, or, for interface 0 of a cloud-init VM, cloud_init.network's.
func staticIPv4(rec *record.Record, i int) bool {
	sp := &rec.Spec
	if i < len(sp.Nets) && sp.Nets[i].IPv4 != nil {
		return true
	}
	return i == 0 && sp.CloudInit != nil && sp.CloudInit.Network != nil && sp.CloudInit.Network.IPv4 != nil
}

// dhcpGuard is the anti-spoof rule FollowDHCP re-pins with each learned
// address, or nil when interface i is not guarded.
func (e *Engine) dhcpGuard(rec *record.Record, i int) *tap.GuardRule {
	var np *record.NetSpec
	if i < len(rec.Spec.Nets) {
		np = &rec.Spec.Nets[i]
	}
	cfg := e.o.Config
	nv := record.ResolveNet(cfg, np, rec.NICs[i])
	policy, _ := cfg.Network(nv.NetworkID)
	guard := policy.SpoofGuard
	if nv.SpoofGuard != nil {
		guard = *nv.SpoofGuard
	}
	if !guard {
		return nil
	}
	r, err := guardRule(rec.NICs[i], nv, i, rec.Spec.CloudInit)
	if err != nil {
		e.log.Warn("building the anti-spoof rule for DHCP pinning", "id", rec.ID, "index", i, "err", err)
		return nil
	}
	return &r
}
