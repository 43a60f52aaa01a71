package vm

import (
	"errors"
	"io/fs"
	"net"
	"sync"
	"time"

	"vmhost/tap"
)

// Guest facts (contract §2.1-2.2): what the host learns about a running
// guest without asking it.
//
//   - nets[].dhcp_snooped_ipv4: the address of the last DHCP ACK snooped on
//     the tap for the guest's MAC (tap.FollowDHCP), for interfaces without a
//     static ipv4. It is stored in the record, and FollowDHCP re-pins the
//     anti-spoof rule to it, so the guard keeps passing the guest's traffic
//     after an agent restart too.
//   - nets[].last_observed_ipv4: the last IPv4 the neighbour table showed for
//     the MAC, polled every factsInterval while the VM runs; stored, so it
//     survives ARP expiry.
//   - discovered_ipv4: the first interface's snooped address, else the first
//     observed one (snooped first, since it is authoritative; the neighbour
//     table only says what the guest asserts).
//   - disk.qsd_* and disk.runtime: the recorded qemu-storage-daemon serving
//     the root disk, while one runs.
//   - pid: the running Cloud Hypervisor (Record.PID, cleared when the VM
//     ends, even while a hung process is still being killed).

// discoveredIPv4 is the view's discovered_ipv4: the first snooped address
// of any interface, else the first observed one.
func discoveredIPv4(nics []NIC) string {
	for _, n := range nics {
		if n.DHCPSnoopedIPv4 != "" {
			return n.DHCPSnoopedIPv4
		}
	}
	for _, n := range nics {
		if n.LastObservedIPv4 != "" {
			return n.LastObservedIPv4
		}
	}
	return ""
}

// qsd returns the recorded storage daemon, or nil (also for a nil rt).
func (rt *Runtime) qsd() *QSDRuntime {
	if rt == nil {
		return nil
	}
	return rt.QSD
}

// defaultFactsInterval is how often a running VM's neighbour-table address
// is read.
const defaultFactsInterval = 5 * time.Second

// tapHost is a Host that reaches the host's taps (the Engine); guest facts
// need its handle to snoop DHCP and read the neighbour table.
type tapHost interface{ tapHandle() *tap.Handle }

func (e *Engine) tapHandle() *tap.Handle { return e.o.Taps }

// tapHandle returns the host's tap handle, or nil when the host has none
// (an agent without CAP_NET_ADMIN, or a test host).
func (s *Service) tapHandle() *tap.Handle {
	if h, ok := s.o.Host.(tapHost); ok {
		return h.tapHandle()
	}
	return nil
}

// facts gathers the guest facts of a watched VM until the monitor ends:
// one DHCP follower per interface without a static IPv4, and a poll of the
// neighbour table for every interface.
func (m *monitor) facts() {
	h := m.s.tapHandle()
	rec := m.s.reg.get(m.id)
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
		guard := m.s.dhcpGuard(rec, i)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := h.FollowDHCP(m.ctx, nic.Tap, mac, guard, func(b tap.Binding) {
				ip := b.IP.String()
				m.s.log.Info("guest address from DHCP", "id", m.id, "tap", nic.Tap, "ipv4", ip)
				m.update(func(r *Record) bool {
					if i >= len(r.NICs) || r.NICs[i].DHCPSnoopedIPv4 == ip {
						return false
					}
					r.NICs[i].DHCPSnoopedIPv4 = ip
					return true
				})
			})
			if err != nil && m.ctx.Err() == nil {
				m.s.log.Warn("DHCP snooping stopped; dhcp_snooped_ipv4 will not follow the guest", "id", m.id, "tap", nic.Tap, "err", err)
			}
		}()
	}
	every := m.s.mon.factsEvery
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
					m.s.log.Warn("reading the neighbour table", "id", m.id, "err", err)
				}
				continue
			}
			ip := addr.String()
			m.update(func(r *Record) bool {
				if i >= len(r.NICs) || r.NICs[i].LastObservedIPv4 == ip {
					return false
				}
				r.NICs[i].LastObservedIPv4 = ip
				return true
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
func staticIPv4(rec *Record, i int) bool {
	sp := &rec.Spec
	if i < len(sp.Nets) && sp.Nets[i].IPv4 != nil {
		return true
	}
	return i == 0 && sp.CloudInit != nil && sp.CloudInit.Network != nil && sp.CloudInit.Network.IPv4 != nil
}

// dhcpGuard is the anti-spoof rule FollowDHCP re-pins with each learned
// address, or nil when interface i is not guarded.
func (s *Service) dhcpGuard(rec *Record, i int) *tap.GuardRule {
	var np *NetSpec
	if i < len(rec.Spec.Nets) {
		np = &rec.Spec.Nets[i]
	}
	cfg := s.o.Config
	nv := ResolveNet(cfg, np, rec.NICs[i])
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
		s.log.Warn("building the anti-spoof rule for DHCP pinning", "id", rec.ID, "index", i, "err", err)
		return nil
	}
	return &r
}
