package api

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/appvm"
	"vmhost/vm"
)

// workloadBody is an AppVM create with every editable spec field.
const workloadBody = `{"vm_id":"wl","image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false,
	"command":["/bin/app","--flag"],"workdir":"/data","user":"1000:1000",
	"healthcheck":{"test":["CMD-SHELL","curl -f http://localhost/"],"interval_secs":5,"timeout_secs":2,"start_period_secs":1,"retries":3},
	"extra_hosts":[{"hostname":"db.internal","ip":"10.0.0.5"}],
	"config_files":[{"path":"/etc/app/app.conf","mode":420,"content":"level=info\n"}],
	"secret_files":[{"path":"/run/secrets/key","content":"` + plantedFile + `"}],
	"tmpfs_mounts":[{"path":"/scratch","size_mb":64,"mode":1023}],
	"stop_grace_secs":30}`

// TestAppVMCreateWorkloadSpec: a create describes the whole workload; the
// view's spec shows what was set, the effective fields what the guest
// runs, secret file contents appear nowhere but the 0600 record and the
// guest's Spec.
func TestAppVMCreateWorkloadSpec(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, workloadBody); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	st, _, body := h.do(t, "GET", "/api/appvm/vms/wl", h.ro, "")
	if st != 200 {
		t.Fatalf("GET: %d %s", st, body)
	}
	var v struct {
		AppVM struct {
			Args          []string             `json:"args"`
			Cwd           string               `json:"cwd"`
			User          string               `json:"user"`
			Healthcheck   *vm.Healthcheck      `json:"healthcheck"`
			ExtraHosts    []vm.ExtraHost       `json:"extra_hosts"`
			InjectedFiles []appvm.InjectedFile `json:"injected_files"`
			TmpfsMounts   []vm.TmpfsMount      `json:"tmpfs_mounts"`
			Spec          appvm.SpecView       `json:"spec"`
		} `json:"appvm"`
	}
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatal(err)
	}
	a := v.AppVM
	if strings.Join(a.Args, " ") != "/bin/app --flag" || a.Cwd != "/data" || a.User != "1000:1000" ||
		a.Healthcheck == nil || a.Healthcheck.Test[0] != "CMD-SHELL" {
		t.Errorf("effective args %q cwd %q user %q healthcheck %+v", a.Args, a.Cwd, a.User, a.Healthcheck)
	}
	sp := a.Spec
	if strings.Join(sp.Command, " ") != "/bin/app --flag" || sp.Workdir != "/data" || sp.StopGraceSecs != 30 ||
		len(sp.ExtraHosts) != 1 || sp.ExtraHosts[0].Hostname != "db.internal" ||
		len(sp.ConfigFiles) != 1 || sp.ConfigFiles[0].Content != "level=info\n" || sp.ConfigFiles[0].Mode != 0o644 ||
		len(sp.SecretFiles) != 1 || sp.SecretFiles[0].Path != "/run/secrets/key" || sp.SecretFiles[0].Mode != 0o400 || !sp.SecretFiles[0].Secret ||
		len(sp.TmpfsMounts) != 1 || sp.TmpfsMounts[0].SizeMB != 64 || sp.TmpfsMounts[0].Mode != 0o1777 {
		t.Errorf("spec view = %+v", sp)
	}
	if len(a.InjectedFiles) != 2 || len(a.ExtraHosts) != 1 || len(a.TmpfsMounts) != 1 {
		t.Errorf("injected %+v, hosts %+v, tmpfs %+v", a.InjectedFiles, a.ExtraHosts, a.TmpfsMounts)
	}
	rec := h.e.Records.Get("wl")
	sp2 := appvm.GuestSpec(rec, 5)
	if len(sp2.SecretFiles) != 1 || sp2.SecretFiles[0].Content.Reveal() != plantedFile || len(sp2.ConfigFiles) != 1 ||
		len(sp2.ExtraHosts) != 1 || sp2.ExtraHosts[0].Host != "db.internal" || len(sp2.TmpfsMounts) != 1 || sp2.TmpfsMounts[0].SizeBytes != 64<<20 ||
		sp2.StopGraceSecs != 30 || sp2.Workdir != "/data" || sp2.User != "1000:1000" || sp2.Healthcheck == nil ||
		strings.Join(sp2.Command, " ") != "/bin/app --flag" || len(sp2.Entrypoint) != 0 {
		t.Errorf("the guest's Spec = %+v", sp2)
	}
	recFile := filepath.Join(h.e.StateDir, "vms", "wl.json")
	data, err := os.ReadFile(recFile)
	if err != nil || !strings.Contains(string(data), plantedFile) {
		t.Errorf("the record file does not keep the secret file's content: %v", err)
	}
	if fi, _ := os.Stat(recFile); fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v", fi.Mode().Perm())
	}
}

// TestAppVMWorkloadSpecRules: each rule of the workload spec answers 400
// naming its field, and a bad secret file never echoes its content.
func TestAppVMWorkloadSpecRules(t *testing.T) {
	h := newHarness(t)
	base := `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false,`
	big := strings.Repeat("x", 1<<20+1)
	for _, c := range []struct{ body, field string }{
		{`"workdir":"relative"}`, "workdir"},
		{`"user":"a b"}`, "user"},
		{`"healthcheck":{"test":["RUN","x"],"interval_secs":1,"timeout_secs":1,"retries":1}}`, "healthcheck.test"},
		{`"healthcheck":{"test":["CMD","x"],"interval_secs":0,"timeout_secs":1,"retries":1}}`, "healthcheck.interval_secs"},
		{`"no_healthcheck":true,"healthcheck":{"test":["CMD","x"],"interval_secs":1,"timeout_secs":1,"retries":1}}`, "healthcheck"},
		{`"extra_hosts":[{"hostname":"-bad","ip":"10.0.0.1"}]}`, "extra_hosts[0].hostname"},
		{`"extra_hosts":[{"hostname":"ok","ip":"999.1.1.1"}]}`, "extra_hosts[0].ip"},
		{`"config_files":[{"path":"/a/../b","content":"x"}]}`, "config_files[0].path"},
		{`"config_files":[{"path":"/a","mode":8192,"content":"x"}]}`, "config_files[0].mode"},
		{`"config_files":[{"path":"/a","content":"` + big + `"}]}`, "config_files[0].content"},
		{`"config_files":[{"path":"/a","content":"x"}],"secret_files":[{"path":"/a","content":"` + plantedFile + `"}]}`, "secret_files[0].path"},
		{`"tmpfs_mounts":[{"path":"/"}]}`, "tmpfs_mounts[0].path"},
		{`"stop_grace_secs":0}`, "stop_grace_secs"},
	} {
		st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, base+c.body)
		if st != 400 || !strings.Contains(b, c.field+":") {
			t.Errorf("%.80s: %d %s, want 400 naming %s", c.body, st, b, c.field)
		}
	}
	mib := strings.Repeat("y", 1<<20)
	var five []string
	for i := range 5 {
		five = append(five, `{"path":"/big`+string(rune('a'+i))+`","content":"`+mib+`"}`)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, base+`"config_files":[`+strings.Join(five, ",")+`]}`); st != 400 || !strings.Contains(b, "config_files[4].content: config and secret files hold at most") {
		t.Errorf("5 MiB of files: %d %.200s", st, b)
	}
	many := make([]string, appvm.MaxInjectedFiles+1)
	for i := range many {
		many[i] = `{"path":"/f` + strings.Repeat("x", i%3) + string(rune('a'+i%26)) + `","content":"x"}`
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, base+`"config_files":[`+strings.Join(many, ",")+`]}`); st != 400 {
		t.Errorf("65 files: %d %s", st, b)
	}
}

// TestAppVMSpecEdit: PATCH keeps absent fields, resets null ones to the
// image default, replaces the rest; a bare secret_env key and a secret
// file without content keep their stored values; a rule is a 400 that
// changes nothing; spec_pending shows on a running AppVM only.
func TestAppVMSpecEdit(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, strings.Replace(workloadBody, `"auto_boot":false,`,
		`"auto_boot":false,"env":["A=1"],"secret_env":["TOKEN=`+plantedSecret+`"],`, 1)); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	patch := func(body string) (int, string) {
		st, _, b := h.do(t, "PATCH", "/api/appvm/vms/wl/spec", h.rw, body)
		return st, b
	}
	if st, b := patch(`{"user":null,"workdir":"/srv","extra_hosts":null,"secret_env":["TOKEN","MORE=x"],"secret_files":[{"path":"/run/secrets/key"}],"stop_grace_secs":5}`); st != 200 {
		t.Fatalf("patch: %d %s", st, b)
	}
	rec := h.e.Records.Get("wl")
	a := rec.AppVM
	if a.User != "" || a.Workdir != "/srv" || len(a.ExtraHosts) != 0 || a.StopGraceSecs != 5 ||
		strings.Join(a.Command, " ") != "/bin/app --flag" || len(a.ConfigFiles) != 1 || strings.Join(a.Env, ",") != "A=1" {
		t.Errorf("after the patch: %+v", a)
	}
	if a.SpecPending {
		t.Error("spec_pending on an AppVM that does not run")
	}
	if len(rec.Secrets.SecretEnv) != 2 || rec.Secrets.SecretEnv[0].Value.Reveal() != plantedSecret || strings.Join(a.SecretEnvKeys, ",") != "TOKEN,MORE" {
		t.Errorf("secret env after keeping TOKEN and adding MORE: keys %v", a.SecretEnvKeys)
	}
	if len(rec.Secrets.Files) != 1 || rec.Secrets.Files[0].Content.Reveal() != plantedFile || rec.Secrets.Files[0].Mode != 0o400 {
		t.Errorf("the secret file without content lost its stored content or mode")
	}
	for _, c := range []struct{ body, want string }{
		{`{"secret_env":["NOPE"]}`, "secret_env[0]"},
		{`{"secret_files":[{"path":"/run/other"}]}`, "secret_files[0].content"},
		{`{"workdir":"x"}`, "workdir"},
		{`{"env":["A=1"],"secret_env":["A=2"]}`, "secret_env[0]"},
	} {
		if st, b := patch(c.body); st != 400 || !strings.Contains(b, c.want+":") {
			t.Errorf("%s: %d %s, want 400 naming %s", c.body, st, b, c.want)
		}
	}
	if after := h.e.Records.Get("wl"); after.AppVM.Workdir != "/srv" || len(after.Secrets.SecretEnv) != 2 {
		t.Error("a refused patch changed the spec")
	}
	if st, b := patch(`{"zz":1}`); st != 422 {
		t.Errorf("unknown field: %d %s", st, b)
	}
	if st, _, b := h.do(t, "PATCH", "/api/appvm/vms/wl/spec?restart=maybe", h.rw, `{}`); st != 400 {
		t.Errorf("restart=maybe: %d %s", st, b)
	}
	if st, _, b := h.do(t, "PATCH", "/api/appvm/vms/none/spec", h.rw, `{}`); st != 404 {
		t.Errorf("unknown AppVM: %d %s", st, b)
	}
	// A running AppVM keeps its spec until its next boot.
	if _, err := h.e.Records.Update("wl", func(r *vm.Record) { r.State = vm.StateRunning }); err != nil {
		t.Fatal(err)
	}
	st, b := patch(`{"command":null}`)
	if st != 200 || !strings.Contains(b, `"spec_pending":true`) {
		t.Errorf("patch of a running AppVM: %d %.300s, want spec_pending", st, b)
	}
}

// TestAppVMRedeploy: a redeploy answers 202 showing redeploying, installs
// the image's current build as the root disk and the AppVM's image, boots
// it, and clears update_available; a failing one keeps the old root disk
// and says why; an importing image is 409 CONFLICT, a redeploy in
// progress 409 INVALID_STATE.
func TestAppVMRedeploy(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"rd","image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	cat := h.apps.Catalog()
	img, _ := cat.Get("web")
	img.BuildDigest = "sha256:feedbeef"
	if err := cat.Put(img); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cat.RootFS(img), []byte("new build"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, b := h.do(t, "GET", "/api/appvm/vms/rd", h.ro, ""); !strings.Contains(b, `"update_available":true`) {
		t.Fatalf("a new build does not show update_available: %.300s", b)
	}
	st, _, b := h.do(t, "POST", "/api/appvm/vms/rd/redeploy", h.rw, "")
	if st != 202 || !strings.Contains(b, `"redeploying":true`) {
		t.Fatalf("redeploy = %d %.300s", st, b)
	}
	h.apps.Wait()
	root := h.vms.Layout().RootDisk("rd")
	if data, _ := os.ReadFile(root); string(data) != "new build" {
		t.Errorf("root disk after the redeploy holds %.20q, want the new build", data)
	}
	_, _, b = h.do(t, "GET", "/api/appvm/vms/rd", h.ro, "")
	if strings.Contains(b, "update_available") || strings.Contains(b, "redeploying") || strings.Contains(b, "redeploy_error") ||
		!strings.Contains(b, `"build_digest":"sha256:feedbeef"`) || !strings.Contains(b, `"state":"running"`) {
		t.Errorf("after the redeploy: %.600s", b)
	}

	// A failure keeps the old disk and says so. (The fake host cannot
	// stop a VM: the AppVM is recorded stopped first.)
	if _, err := h.e.Records.Update("rd", func(r *vm.Record) { r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped) }); err != nil {
		t.Fatal(err)
	}
	h.e.Host.FailStage = errors.New("no space left on device")
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/rd/redeploy", h.rw, ""); st != 202 {
		t.Fatalf("second redeploy = %d %s", st, b)
	}
	h.apps.Wait()
	h.e.Host.FailStage = nil
	_, _, b = h.do(t, "GET", "/api/appvm/vms/rd", h.ro, "")
	if !strings.Contains(b, `"redeploy_error":"staging the new root disk: no space left on device"`) || strings.Contains(b, "redeploying") {
		t.Errorf("after a failed redeploy: %.800s", b)
	}
	if data, _ := os.ReadFile(root); string(data) != "new build" {
		t.Error("a failed redeploy changed the root disk")
	}
	if _, err := os.Stat(h.vms.Layout().RootDiskNext("rd")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a failed redeploy left its staged disk: %v", err)
	}

	// 409s.
	if _, err := h.e.Records.Update("rd", func(r *vm.Record) { r.AppVM.Redeploy = &vm.Redeploy{} }); err != nil {
		t.Fatal(err)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/rd/redeploy", h.rw, ""); st != 409 || !strings.Contains(b, CodeInvalidState) {
		t.Errorf("redeploy during a redeploy = %d %s", st, b)
	}
	if _, err := h.e.Records.Update("rd", func(r *vm.Record) { r.AppVM.Redeploy = nil }); err != nil {
		t.Fatal(err)
	}
	img.Status = appvm.StatusImporting
	cat.Put(img)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/rd/redeploy", h.rw, ""); st != 409 || !strings.Contains(b, CodeConflict) {
		t.Errorf("redeploy while the image imports = %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/none/redeploy", h.rw, ""); st != 404 {
		t.Errorf("redeploy of an unknown AppVM = %d %s", st, b)
	}
}

// TestRecoverRedeploys: an agent killed after staging rolls the redeploy
// forward at its next start (new root disk and build, AppVM stopped); one
// killed before rolls it back (old disk, staged leftovers removed,
// redeploy_error set).
func TestRecoverRedeploys(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"fwd", "back"} {
		if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"`+id+`","image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
	}
	l := h.vms.Layout()
	to := vm.Workload{BuildDigest: "sha256:next", Cmd: []string{"/new"}}
	for id, staged := range map[string]bool{"fwd": true, "back": false} {
		if err := os.WriteFile(l.RootDisk(id), []byte("old"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(l.RootDiskNext(id), []byte("new"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := h.e.Records.Update(id, func(r *vm.Record) { r.AppVM.Redeploy = &vm.Redeploy{To: to, Staged: staged} }); err != nil {
			t.Fatal(err)
		}
	}
	h.start(t) // the agent starts again
	h.apps.RecoverRedeploys(context.Background())
	fwd, back := h.e.Records.Get("fwd"), h.e.Records.Get("back")
	if data, _ := os.ReadFile(l.RootDisk("fwd")); string(data) != "new" || fwd.AppVM.Redeploy != nil || fwd.AppVM.Image.BuildDigest != "sha256:next" {
		t.Errorf("rolled forward: root %q, redeploy %+v, digest %s", data, fwd.AppVM.Redeploy, fwd.AppVM.Image.BuildDigest)
	}
	if data, _ := os.ReadFile(l.RootDisk("back")); string(data) != "old" || back.AppVM.Redeploy != nil || back.AppVM.RedeployError == "" || back.AppVM.Image.BuildDigest == "sha256:next" {
		t.Errorf("rolled back: root %q, redeploy %+v, error %q", data, back.AppVM.Redeploy, back.AppVM.RedeployError)
	}
	for _, id := range []string{"fwd", "back"} {
		if _, err := os.Stat(l.RootDiskNext(id)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s: a staged disk is left: %v", id, err)
		}
	}
}
