package appvm

import (
	"time"

	"vmhost/vm"
)

// WaitingForLease is appvm.waiting_for while a running DHCP AppVM's guest
// agent has its spec but has reported no lease yet (nor a workload end):
// it sets up the network before anything else, so it waits for an offer.
const WaitingForLease = "dhcp_lease"

// guestView fills the guest-reported fields of the view from the record's
// guest facts and the live session: last_heartbeat_at is the latest
// heartbeat this process received (the record holds a throttled copy), and
// heartbeat_stale is derived at read time: the AppVM runs, had a
// heartbeat this boot, and none came for StaleAfter intervals. health is
// shown only while the AppVM runs (a stopped workload has none), and
// waiting_for says what the guest waits for before the workload starts.
func (s *Service) guestView(rec *vm.Record, av *AppvmView) {
	g := rec.AppVM.Guest
	if g == nil {
		return
	}
	if l := g.Lease; l != nil {
		av.Lease = &LeaseView{IP: l.IP, Prefix: l.Prefix, Gateway: l.Gateway, DNS: l.DNS, Search: l.Search,
			LeaseSecs: l.LeaseSecs, Hostname: l.Hostname, ReportedAt: l.ReportedAt}
	}
	av.WorkloadExitCode, av.WorkloadExitSignal, av.WorkloadFatal = g.ExitCode, g.ExitSignal, g.Fatal
	up := rec.State == vm.StateRunning || rec.State == vm.StatePaused
	if up {
		av.Health, av.HealthFailingStreak = g.Health, g.HealthStreak
	}
	if up && g.BootID != "" && rec.AppVM.NetworkMode == NetworkDHCP && g.Lease == nil && g.Fatal == "" && g.ExitCode == nil && g.ExitSignal == 0 {
		av.WaitingFor = WaitingForLease
	}
	av.LogStreamDetached = g.LogStreamDetached
	av.RestartCount, av.LastRestartAt = g.RestartCount, g.LastRestartAt
	at, stale := s.guests.liveHeartbeat(rec)
	if !at.IsZero() {
		t := at.UTC().Truncate(time.Second)
		if g.LastHeartbeatAt != nil || s.guests.get(rec.ID) != nil {
			av.LastHeartbeatAt = &t
		}
	}
	av.HeartbeatStale = stale && rec.State == vm.StateRunning
}

// LastHeartbeat is the latest heartbeat of rec's guest this process knows
// (zero when none) and whether it is stale, as the view shows them.
func (s *Service) LastHeartbeat(rec *vm.Record) (at time.Time, stale bool) {
	if rec.AppVM == nil {
		return time.Time{}, false
	}
	at, stale = s.guests.liveHeartbeat(rec)
	return at, stale && rec.State == vm.StateRunning
}
