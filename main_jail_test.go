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
// unset, the agent confines classic VMs but not AppVMs, and says why,
// once; jail.enabled true confines AppVMs too, and so does the qemu
// backend by default, as real Cloud Hypervisor does.
func TestJailerUnderProcessGuests(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: without it the agent never confines VMs")
	}
	cases := []struct {
		name    string
		simCH   bool
		args    []string
		enabled *bool
		want    bool // classic VMs confined
		appVMs  bool // AppVMs confined too
	}{
		{"process guests, unset", true, nil, nil, true, false},
		{"process guests, sim backend named", true, []string{"--sim-backend", "sim"}, nil, true, false},
		{"process guests, enabled true", true, nil, new(true), true, true},
		{"process guests, enabled false", true, nil, new(false), false, false},
		{"qemu backend, unset", true, []string{"--sim-backend", "qemu"}, nil, true, true},
		{"real cloud hypervisor, unset", false, nil, nil, true, true},
		{"real cloud hypervisor, enabled false", false, nil, new(false), false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs bytes.Buffer
			cfg := config.Default()
			cfg.Jail.Enabled = c.enabled
			env := serveEnv{RunDir: t.TempDir(), Config: cfg, Log: slog.New(slog.NewTextHandler(&logs, nil)),
				AgentID: "0123456789abcdef", SimCH: c.simCH, SimCHArgs: c.args}
			j, appVMsUnconfined, err := newJailer(env)
			if err != nil {
				t.Fatal(err)
			}
			out := logs.String()
			// Only a jail that confines classic VMs names a reason of
			// its own for AppVMs.
			if j.Enabled() != c.want || (appVMsUnconfined != "") != (c.want && !c.appVMs) {
				t.Fatalf("confined = %v, AppVMs unconfined because %q; want %v, AppVMs confined %v (log: %s)",
					j.Enabled(), appVMsUnconfined, c.want, c.appVMs, out)
			}
			said := strings.Count(out, `msg="AppVMs run unconfined"`)
			if wantSaid := c.want && !c.appVMs; (said == 1) != wantSaid || said > 1 {
				t.Errorf("the agent said %d times that AppVMs run unconfined:\n%s", said, out)
			}
			if n := strings.Count(out, `msg="VMs run unconfined"`) + strings.Count(out, `msg="VMs run confined"`); n != 1 {
				t.Errorf("the agent said %d times whether VMs run confined, want once:\n%s", n, out)
			}
		})
	}
}
