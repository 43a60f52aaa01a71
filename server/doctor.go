package server

import (
	"log/slog"
	"strings"

	"vmhost/doctor"
)

// checkHost logs, once at start, what the host checks (vmhost doctor)
// found lacking; serve starts all the same. An agent logs each warning and
// each failure with its fix (doctor.Log): a missing cloud-hypervisor or
// bridge is known before the first create fails. A dev agent, whose
// simulators need none of what real VMs need, says in one line which
// checks a host for real VMs would have to pass.
func checkHost(log *slog.Logger, checks []doctor.Check, dev bool) {
	if !dev {
		doctor.Log(log, checks)
		return
	}
	var lacking []string
	for _, c := range checks {
		if c.Status != doctor.OK {
			lacking = append(lacking, c.Name)
		}
	}
	if len(lacking) > 0 {
		log.Info("dev mode: the simulators stand in for what real VMs would need here (vmhost doctor says how to fix it)",
			"lacking", strings.Join(lacking, ", "))
	}
}
