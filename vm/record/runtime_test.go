package record

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestLayoutSocketPaths(t *testing.T) {
	l := Layout{StateDir: "/var/lib/vmhost", RunDir: "/run/vmhost"}
	id := strings.Repeat("a", 64)
	for _, p := range []string{l.APISocket(id), l.Events(id), l.VsockSocket(id) + "_65535", l.QMPSocket(id), l.RootSocket(id), l.DataSocket(id, "data31"), l.ConsoleSocket(id)} {
		if len(p) > MaxSocketPath {
			t.Errorf("%s is %d bytes", p, len(p))
		}
		if !strings.HasPrefix(p, "/run/vmhost/vms/"+id+"/") {
			t.Errorf("%s is outside the VM's run dir", p)
		}
	}
	if err := l.CheckSocketPaths(id); err != nil {
		t.Errorf("CheckSocketPaths(64-byte id) = %v, want nil", err)
	}
	if err := l.CheckRunDir(); err != nil {
		t.Errorf("CheckRunDir(/run/vmhost) = %v", err)
	}
	long := Layout{RunDir: "/" + strings.Repeat("r", 60)}
	if err := long.CheckRunDir(); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("CheckRunDir(61 bytes) = %v, want an error naming the limit", err)
	}
	if err := (Layout{RunDir: "/tmp/x"}).CheckSocketPaths(strings.Repeat("b", 90)); err == nil {
		t.Error("CheckSocketPaths(90-byte id) = nil, want an error")
	}
}

func TestRuntimeRoundTrip(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	r := &Record{ID: "x", Mode: ModeVM, State: StateRunning, ShuttingDown: true, GuestPanickedAt: &at,
		Runtime: &Runtime{Steps: []string{StepRootDisk, StepData(0), StepTap(1)}, VsockCID: 7,
			CH:  &CHRuntime{Pid: 10, StartTime: 20, APISocket: "/r/ch.sock", EventsPath: "/r/events"},
			QSD: &QSDRuntime{Pid: 11, StartTime: 21, QMPSocket: "/r/qsd.qmp", DataSockets: []string{"/r/data0.vhost"}}}}
	c := r.Clone()
	if !reflect.DeepEqual(c, r) {
		t.Errorf("clone = %+v, want %+v", c, r)
	}
	if !c.Runtime.Done("tap1") || c.Runtime.Done(StepSeed) || (*Runtime)(nil).Done(StepSeed) {
		t.Error("Done gives wrong answers")
	}
}
