package engine

import (
	"context"
	"os"
	"slices"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/vm/record"
)

// activatedIDs lists the ids of the virtio-device activated events in the
// CH event file at path, in order.
func activatedIDs(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var ids []string
	r := chclient.NewEventReader(f)
	for {
		ev, err := r.Next()
		if err != nil {
			return ids
		}
		if ev.Source == "virtio-device" && ev.Event == "activated" {
			ids = append(ids, ev.Properties["id"])
		}
	}
}

// TestEngineClassicLifeFromBalloon: a classic VM without a seed or NICs
// whose guest takes only its balloon shows life on that one activation.
// Its root disk and data volume are vhost-user, which CH v53 never
// announces, so the balloon every VM has is what a stock guest's first
// sign can be.
func TestEngineClassicLifeFromBalloon(t *testing.T) {
	s := simService(t, func(o *Options) { o.CH.PreArgs = []string{"--sim-no-activate"} })
	sp := baseSpec(t, s.root, "v")
	sp.AutoBoot = true
	rec := s.mustCreate(t, sp)
	if rec.State != record.StateRunning || rec.DisplayState != record.DisplayBooting {
		t.Fatalf("after the boot: %s, want running/booting", describe(rec))
	}
	time.Sleep(300 * time.Millisecond)
	if r := s.recs.Get("v"); r.DisplayState != record.DisplayBooting {
		t.Fatalf("display %s before any device was activated, want booting", r.DisplayState)
	}
	simAction(t, s.lay.APISocket("v"), "activate", `{"devices":["__balloon"]}`)
	waitRecord(t, s, "v", 5*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == string(record.StateRunning) })
	if got := activatedIDs(t, s.lay.Events("v")); !slices.Equal(got, []string{"__balloon"}) {
		t.Errorf("activations %v, want the balloon's alone", got)
	}
	// The rest of the guest's drivers: the vhost-user disks stay silent.
	simAction(t, s.lay.APISocket("v"), "activate", "")
	if got := activatedIDs(t, s.lay.Events("v")); slices.Contains(got, "_disk0") || slices.Contains(got, "_disk1") {
		t.Errorf("activations %v include a vhost-user disk (_disk0 root, _disk1 data0)", got)
	}
}

// TestRecoverReplaysLifeOfTheLatestBoot: a restarted agent reads the CH
// event stream from its start. A VM that showed life stays running; a VM
// rebooted by the operator whose guest has not shown life again since
// stays booting, although the stream holds the first boot's activations;
// its next activation turns it running.
func TestRecoverReplaysLifeOfTheLatestBoot(t *testing.T) {
	ctx := context.Background()
	a := newTestService(t)
	r := startVM(t, a, "rb", "--sim-no-activate")
	a.watch(r.id, r.ch, r.qsd)
	r.sim(t, "activate", "")
	waitRecord(t, a, "rb", 5*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == string(record.StateRunning) })

	// panicked waits until a guest panic after since is recorded: by then
	// the monitor has read every event before it.
	panicked := func(s *testService, since *time.Time) *time.Time {
		t.Helper()
		r.sim(t, "panic", `{"event":"panic"}`)
		got, _ := waitRecord(t, s, "rb", 5*time.Second, "guest panic read", func(r *record.Record) bool {
			return r.GuestPanickedAt != nil && (since == nil || r.GuestPanickedAt.After(*since))
		})
		return got.GuestPanickedAt
	}

	b := a.restart(t)
	if rep := b.Recovery(); !slices.Equal(rep.Adopted, []string{"rb"}) {
		t.Fatalf("recovery = %+v", rep)
	}
	at := panicked(b, nil)
	if got := b.recs.Get("rb"); got.DisplayState != string(record.StateRunning) {
		t.Fatalf("after the restart: %s, want display running", describe(got))
	}

	if _, err := b.act(ctx, "rb", "reboot"); err != nil {
		t.Fatal(err)
	}
	if got := b.recs.Get("rb"); got.DisplayState != record.DisplayBooting {
		t.Fatalf("after the reboot: %s, want display booting", describe(got))
	}
	at = panicked(b, at) // the monitor has read vm rebooting and rebooted
	c := b.restart(t)
	if rep := c.Recovery(); !slices.Equal(rep.Adopted, []string{"rb"}) {
		t.Fatalf("second recovery = %+v", rep)
	}
	panicked(c, at)
	if got := c.recs.Get("rb"); got.DisplayState != record.DisplayBooting {
		t.Fatalf("after a restart replayed the first boot's activations: %s, want display booting", describe(got))
	}
	r.sim(t, "activate", "")
	waitRecord(t, c, "rb", 5*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == string(record.StateRunning) })
}
