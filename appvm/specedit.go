package appvm

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"vmhost/vm"
)

// SpecEdit is the body of PATCH /api/appvm/vms/{id}/spec (docs/api.md
// §5): the values of the fields given. SpecPatch says which were given.
type SpecEdit struct {
	Keepalive     bool             `json:"keepalive,omitempty"`
	Command       []string         `json:"command,omitempty"`
	Env           []string         `json:"env,omitempty"`
	SecretEnv     []vm.Secret      `json:"secret_env,omitempty"`
	Workdir       string           `json:"workdir,omitempty"`
	User          string           `json:"user,omitempty"`
	NoHealthcheck bool             `json:"no_healthcheck,omitempty"`
	Healthcheck   *vm.Healthcheck  `json:"healthcheck,omitempty"`
	ExtraHosts    []vm.ExtraHost   `json:"extra_hosts,omitempty"`
	ConfigFiles   []vm.ConfigFile  `json:"config_files,omitempty"`
	SecretFiles   []SecretFileEdit `json:"secret_files,omitempty"`
	TmpfsMounts   []vm.TmpfsMount  `json:"tmpfs_mounts,omitempty"`
	RestartPolicy RestartPolicy    `json:"restart_policy,omitempty"`
	StopGraceSecs *uint32          `json:"stop_grace_secs,omitempty"`
}

// SecretFileEdit is a secret file of an edit: without content it keeps
// the content stored for its path.
type SecretFileEdit struct {
	Path    string     `json:"path" decode:"required"`
	Mode    uint32     `json:"mode,omitempty"`
	Content *vm.Secret `json:"content,omitempty"`
}

// SpecPatch is an edit: Values for the fields in Given, and the fields in
// Reset (given as null) back to the image's default. A field in neither
// stays as stored.
type SpecPatch struct {
	Values       SpecEdit
	Given, Reset map[string]bool
}

// restartWait bounds how long a restarting edit waits for the workload's
// graceful stop beyond its grace.
const restartWait = 30 * time.Second

// EditSpec applies p to the AppVM id's stored spec (400 *vm.FieldError
// for a rule, fs.ErrNotExist when there is no such AppVM). A running or
// paused AppVM keeps running on its old spec and shows spec_pending until
// its next boot, unless restart is set: then it stops gracefully (the
// workload gets its stop grace) and boots on the new spec before EditSpec
// returns. Secret values go to the record's secrets only.
//
// The restart is recorded with the spec (AppVMSpec.Restart), before the
// stop, so that an agent killed before the AppVM runs on its new spec
// finishes the restart when it starts again (FinishRestarts).
func (s *Service) EditSpec(ctx context.Context, id string, p SpecPatch, restart bool) (*vm.Record, error) {
	out, up, err := s.storeSpec(id, p, restart)
	if err != nil {
		return nil, err
	}
	s.guests.log.Info("AppVM spec edited", "id", id, "fields", strings.Join(p.fields(), ","), "pending", up, "restart", restart && up)
	if !restart || !up {
		return out, nil
	}
	out, err = s.restartNow(ctx, out)
	s.endRestart(id)
	return out, err
}

// storeSpec stores p applied to AppVM id's spec under its action lock; up
// says the AppVM runs on its old spec meanwhile. With restart, a running
// AppVM's restart is recorded in the same write.
func (s *Service) storeSpec(id string, p SpecPatch, restart bool) (out *vm.Record, up bool, err error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	rec, err := s.Get(id)
	if err != nil {
		return nil, false, err
	}
	a, secrets, err := p.merge(rec)
	if err != nil {
		return nil, false, err
	}
	up = rec.State == vm.StateRunning || rec.State == vm.StatePaused
	out, err = s.recs.Update(id, func(r *vm.Record) {
		gen := r.AppVM.SpecGen
		a.Guest, a.Booted = r.AppVM.Guest, r.AppVM.Booted
		r.AppVM = a
		r.AppVM.SpecGen = gen + 1
		r.AppVM.SpecPending = up
		if up && restart {
			r.AppVM.Restart = restartOf(r)
		}
		r.Secrets.SecretEnv, r.Secrets.Files = secrets.SecretEnv, secrets.Files
	})
	if err != nil {
		return nil, false, &vm.HostError{Kind: vm.HostStorage, Op: "storing the spec of AppVM " + id, Err: err}
	}
	return out, up, nil
}

// restartNow stops rec gracefully and boots it.
func (s *Service) restartNow(ctx context.Context, rec *vm.Record) (*vm.Record, error) {
	if _, err := s.restartStop(ctx, rec); err != nil {
		return nil, err
	}
	return s.vms.Act(ctx, vm.ModeAppVM, rec.ID, vm.ActionStart)
}

// restartStop stops rec (running: a graceful shutdown with its stop grace;
// paused, or not yet greeted by its guest agent: at once) and waits,
// bounded, until it is stopped or failed. A stop whose request failed but
// which stopped the VM all the same (CH exits while answering the power
// button) counts as done.
func (s *Service) restartStop(ctx context.Context, rec *vm.Record) (*vm.Record, error) {
	action := vm.ActionShutdown
	if rec.State == vm.StatePaused || !greeted(rec) {
		action = vm.ActionStop
	}
	_, actErr := s.vms.Act(ctx, vm.ModeAppVM, rec.ID, action)
	grace := time.Duration(rec.AppVM.StopGraceSecs) * time.Second
	if grace == 0 {
		grace = 10 * time.Second
	}
	deadline := time.Now().Add(grace + restartWait)
	for {
		cur, err := s.Get(rec.ID)
		if err != nil {
			return nil, err
		}
		if cur.State == vm.StateStopped || cur.State == vm.StateFailed {
			return cur, nil
		}
		if actErr != nil && cur.State != vm.StateRunning && cur.State != vm.StatePaused {
			return nil, actErr // neither stopped nor running: nothing to wait for
		}
		if time.Now().After(deadline) {
			if actErr != nil {
				return nil, actErr
			}
			return nil, &vm.StateError{ID: rec.ID, Action: "restart", State: cur.DisplayState + " (it did not stop within " + (grace + restartWait).String() + ")"}
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// greeted says whether the guest agent of AppVM rec said hello in its
// current boot. Before that no workload runs, so a restart loses nothing
// by stopping at once, and a kernel still booting would not yet take the
// power button a graceful shutdown falls back to.
func greeted(rec *vm.Record) bool {
	gst := rec.AppVM.Guest
	return gst != nil && gst.BootID != ""
}

// fields lists the names the patch touches, for the log (never values).
func (p SpecPatch) fields() []string {
	var out []string
	for k := range p.Given {
		out = append(out, k)
	}
	for k := range p.Reset {
		out = append(out, k+"=null")
	}
	slices.Sort(out)
	return out
}

// merge returns rec's AppVM spec and secrets with p applied, validated.
func (p SpecPatch) merge(rec *vm.Record) (*vm.AppVMSpec, vm.Secrets, error) {
	c := *rec.AppVM // a copy; every change below assigns, never mutates shared slices
	a := &c
	secrets := vm.Secrets{SecretEnv: slices.Clone(rec.Secrets.SecretEnv), Files: slices.Clone(rec.Secrets.Files)}
	v := p.Values
	pick := func(name string, set, reset func()) {
		switch {
		case p.Given[name]:
			set()
		case p.Reset[name]:
			reset()
		}
	}
	pick("keepalive", func() { a.Keepalive = v.Keepalive }, func() { a.Keepalive = false })
	pick("command", func() { a.Command = v.Command }, func() { a.Command = nil })
	pick("env", func() { a.Env = v.Env }, func() { a.Env = nil })
	pick("workdir", func() { a.Workdir = v.Workdir }, func() { a.Workdir = "" })
	pick("user", func() { a.User = v.User }, func() { a.User = "" })
	pick("no_healthcheck", func() { a.NoHealthcheck = v.NoHealthcheck }, func() { a.NoHealthcheck = false })
	pick("healthcheck", func() { a.Healthcheck = v.Healthcheck }, func() { a.Healthcheck = nil })
	pick("extra_hosts", func() { a.ExtraHosts = v.ExtraHosts }, func() { a.ExtraHosts = nil })
	pick("config_files", func() { a.ConfigFiles = v.ConfigFiles }, func() { a.ConfigFiles = nil })
	pick("tmpfs_mounts", func() { a.TmpfsMounts = v.TmpfsMounts }, func() { a.TmpfsMounts = nil })
	pick("restart_policy", func() { a.RestartPolicy = string(v.RestartPolicy) }, func() { a.RestartPolicy = "no" })
	pick("stop_grace_secs", func() { a.StopGraceSecs = *v.StopGraceSecs }, func() { a.StopGraceSecs = 0 })

	// secret_env: KEY=VALUE sets, a bare KEY keeps its stored value.
	var secretEnv []string
	if p.Given["secret_env"] {
		stored := map[string]vm.Secret{}
		for _, e := range rec.Secrets.SecretEnv {
			stored[e.Key] = e.Value
		}
		for i, item := range v.SecretEnv {
			kv := item.Reveal()
			if !strings.Contains(kv, "=") {
				old, ok := stored[kv]
				if !ok {
					return nil, vm.Secrets{}, bad(fmt.Sprintf("secret_env[%d]", i), "keeps the stored value of a key that has none")
				}
				kv += "=" + old.Reveal()
			}
			secretEnv = append(secretEnv, kv)
		}
	} else if !p.Reset["secret_env"] {
		for _, e := range rec.Secrets.SecretEnv {
			secretEnv = append(secretEnv, e.Key+"="+e.Value.Reveal())
		}
	}
	keys := map[string]string{}
	if err := checkEnv("env", slices.Clone(a.Env), keys); err != nil {
		return nil, vm.Secrets{}, err
	}
	if err := checkEnv("secret_env", secretEnv, keys); err != nil {
		return nil, vm.Secrets{}, err
	}
	a.SecretEnvKeys, secrets.SecretEnv = nil, nil
	for _, kv := range secretEnv {
		k, val, _ := strings.Cut(kv, "=")
		a.SecretEnvKeys = append(a.SecretEnvKeys, k)
		secrets.SecretEnv = append(secrets.SecretEnv, vm.SecretEnv{Key: k, Value: vm.Secret(val)})
	}

	// secret_files: an item without content keeps its path's stored one.
	var files []SecretFileRequest
	switch {
	case p.Given["secret_files"]:
		for i, f := range v.SecretFiles {
			r := SecretFileRequest{Path: f.Path, Mode: f.Mode}
			if f.Content != nil {
				r.Content = *f.Content
			} else {
				j := slices.IndexFunc(rec.Secrets.Files, func(s vm.SecretFile) bool { return s.Path == f.Path })
				if j < 0 {
					return nil, vm.Secrets{}, bad(fmt.Sprintf("secret_files[%d].content", i), "required: no secret file is stored at %s", f.Path)
				}
				r.Content = rec.Secrets.Files[j].Content
				if r.Mode == 0 {
					r.Mode = rec.Secrets.Files[j].Mode
				}
			}
			files = append(files, r)
		}
	case !p.Reset["secret_files"]:
		for _, f := range rec.Secrets.Files {
			files = append(files, SecretFileRequest{Path: f.Path, Mode: f.Mode, Content: f.Content})
		}
	}
	var grace *uint32
	if g := a.StopGraceSecs; g > 0 {
		grace = &g // a copy: apply resets the field before it reads this
	}
	w := workloadSpec{Command: a.Command, Workdir: a.Workdir, User: a.User, NoHealthcheck: a.NoHealthcheck,
		Healthcheck: a.Healthcheck, ExtraHosts: a.ExtraHosts, ConfigFiles: a.ConfigFiles, SecretFiles: files,
		TmpfsMounts: a.TmpfsMounts, StopGraceSecs: grace}
	if err := w.validate(); err != nil {
		return nil, vm.Secrets{}, err
	}
	w.apply(a, &secrets)
	return a, secrets, nil
}
