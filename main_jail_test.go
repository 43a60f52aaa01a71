package main

import (
	"bytes"
	"log/slog"
	"os"
	"strings"
	"testing"

	"vmhost/config"
)

// TestJailerUnderProcessGuests: with the Cloud Hypervisor simulator's
// default backend (its AppVM guests are host processes) and jail.enabled
// unset, the agent does not confine VMs and says why, once; jail.enabled
// true confines them anyway, and so does the qemu backend by default, as
// real Cloud Hypervisor does.
func TestJailerUnderProcessGuests(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: without it the agent never confines VMs")
	}
	cases := []struct {
		name    string
		simCH   bool
		args    []string
		enabled *bool
		want    bool
	}{
		{"process guests, unset", true, nil, nil, false},
		{"process guests, sim backend named", true, []string{"--sim-backend", "sim"}, nil, false},
		{"process guests, enabled true", true, nil, new(true), true},
		{"qemu backend, unset", true, []string{"--sim-backend", "qemu"}, nil, true},
		{"real cloud hypervisor, unset", false, nil, nil, true},
		{"real cloud hypervisor, enabled false", false, nil, new(false), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs bytes.Buffer
			cfg := config.Default()
			cfg.Jail.Enabled = c.enabled
			env := serveEnv{RunDir: t.TempDir(), Config: cfg, Log: slog.New(slog.NewTextHandler(&logs, nil)),
				AgentID: "0123456789abcdef", SimCH: c.simCH, SimCHArgs: c.args}
			j, err := newJailer(env)
			if err != nil {
				t.Fatal(err)
			}
			if j.Enabled() != c.want {
				t.Fatalf("confined = %v, want %v (log: %s)", j.Enabled(), c.want, logs.String())
			}
			out := logs.String()
			said := strings.Count(out, "process-mode guest runs on the host; VMs are not confined")
			if wantSaid := !c.want && c.simCH; (said == 1) != wantSaid || said > 1 {
				t.Errorf("the agent said %d times that the process-mode guest leaves VMs unconfined:\n%s", said, out)
			}
			if n := strings.Count(out, `msg="VMs run unconfined"`) + strings.Count(out, `msg="VMs run confined"`); n != 1 {
				t.Errorf("the agent said %d times whether VMs run confined, want once:\n%s", n, out)
			}
		})
	}
}
