package chsim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"
)

// vm.snapshot and vm.restore in the qemu backend: the guest's memory and device state are
// qemu's own migration stream, written to a file of the snapshot directory (migrate to a
// file descriptor passed over the monitor) and read back by a new qemu (-incoming fd:N)
// started for the restore. qemu refuses to migrate a VM with a device it cannot save; the
// snapshot then fails with qemu's reasons. vhost-user-vsock is one such device: it is
// unplugged first (qemu_vsock.go).

// migrationTimeout bounds writing or reading one migration stream.
const migrationTimeout = 10 * time.Minute

// maxMigrationBandwidth lifts qemu's migration rate limit (128 MiB/s by default in 7.2):
// a file has no peer to leave bandwidth to.
const maxMigrationBandwidth = 1 << 40

// snapshotFDName is the name the destination file gets on qemu's monitor.
const snapshotFDName = "chsim-snapshot"

// qemuSnapshotBlockedLocked says why qemu cannot save the VM, or "".
func (s *sim) qemuSnapshotBlockedLocked() string {
	if len(s.qemu.hot) > 0 {
		// A restore starts qemu from the config, which has no root ports for them.
		return "the qemu backend cannot snapshot a VM with hot-plugged disks"
	}
	var status struct {
		Status string `json:"status"`
	}
	if err := s.qmpArgsLocked("query-status", nil, &status); err != nil {
		return "asking qemu for the VM's state: " + err.Error()
	}
	if status.Status == "postmigrate" {
		// qemu's words for what its migrate would answer.
		return "qemu cannot save this VM again before it runs: Can't migrate the vm that was paused due to previous migration"
	}
	if err := s.qemuUnplugVsockLocked(); err != nil {
		return err.Error()
	}
	var st struct {
		BlockedReasons []string `json:"blocked-reasons"`
	}
	if err := s.qmpArgsLocked("query-migrate", nil, &st); err != nil {
		return "asking qemu whether it can save the VM: " + err.Error()
	}
	if len(st.BlockedReasons) > 0 {
		return "qemu cannot save this VM: " + strings.Join(st.BlockedReasons, "; ")
	}
	return ""
}

// qemuSaveLocked has the paused guest's qemu write its migration stream into f and returns
// once qemu reports it complete (everything is written to f by then).
func (s *sim) qemuSaveLocked(f *os.File) error {
	q := s.qemu
	ctx, cancel := context.WithTimeout(context.Background(), migrationTimeout)
	defer cancel()
	if err := q.client.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": maxMigrationBandwidth}, nil); err != nil {
		return err
	}
	if err := q.client.GetFD(ctx, snapshotFDName, f); err != nil {
		return err
	}
	if err := q.client.Execute(ctx, "migrate", map[string]string{"uri": "fd:" + snapshotFDName}, nil); err != nil {
		q.client.Execute(ctx, "closefd", map[string]string{"fdname": snapshotFDName}, nil)
		return err
	}
	return q.waitMigration(ctx)
}

// waitMigration waits until qemu reports its migration (out or in) completed.
func (q *qemuVM) waitMigration(ctx context.Context) error {
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := q.client.Execute(ctx, "query-migrate", nil, &st); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("qemu's migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-q.exited:
			return errors.New("qemu exited")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// restoreQemuLocked starts a qemu for the restored config that loads the guest from
// stream, stopped, and reports the devices the guest's drivers had as activated. It
// returns the chain below "The VM could not be restored", with nothing left running.
func (s *sim) restoreQemuLocked(stream string) []string {
	f, err := os.Open(stream)
	if err != nil {
		return []string{"Memory manager error", "Error opening snapshot file", osError(err)}
	}
	q, err := s.startQemu(f)
	if err != nil {
		s.logf(0, "Error: restoring in qemu: %v", err)
		return []string{"Cannot restore VM", "Failed to restore migratable component", err.Error()}
	}
	s.qemu = q
	// As CH activates the restored devices while it creates them, before "restoring".
	q.poll(true)
	go q.pollActivation()
	return nil
}
