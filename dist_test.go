package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// distTool finds a checker: a test skips without it, except in CI (CI
// set), which installs it and must not pass by skipping.
func distTool(t *testing.T, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not installed (apt-get install %s), and CI is set", name, pkg)
		}
		t.Skipf("%s not installed (apt-get install %s)", name, pkg)
	}
	return p
}

// unitSettings reads the KEY=value lines of a systemd unit.
func unitSettings(t *testing.T, path string) map[string][]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string][]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(l, "#") {
			m[k] = append(m[k], v)
		}
	}
	return m
}

// TestUnit: dist/vmhost.service has what the agent relies on, and
// systemd-analyze verify accepts it (with ExecStart pointing at the test
// binary, since verify checks that the program exists).
func TestUnit(t *testing.T) {
	got := unitSettings(t, "dist/vmhost.service")
	for k, want := range map[string]string{
		"Type":                     "notify",
		"NotifyAccess":             "main",
		"KillMode":                 "process",
		"Restart":                  "on-failure",
		"ExecReload":               "/bin/kill -HUP $MAINPID",
		"LimitNOFILE":              "65536",
		"StateDirectory":           "vmhost",
		"RuntimeDirectory":         "vmhost",
		"RuntimeDirectoryPreserve": "yes", // the VMs' sockets outlive a stop
		"WantedBy":                 "multi-user.target",
	} {
		if !slices.Equal(got[k], []string{want}) {
			t.Errorf("%s = %q, want %q", k, got[k], want)
		}
	}
	execStart := strings.Join(got["ExecStart"], "")
	for _, want := range []string{"/usr/bin/vmhost serve ", "--config /etc/vmhost/config.json", "--state-dir /var/lib/vmhost", "--run-dir /run/vmhost", "--listen ${VMHOST_LISTEN}"} {
		if !strings.Contains(execStart, want) {
			t.Errorf("ExecStart = %q, want it to contain %q", execStart, want)
		}
	}

	analyze := distTool(t, "systemd-analyze", "systemd")
	b, _ := os.ReadFile("dist/vmhost.service")
	dir := t.TempDir()
	unit := filepath.Join(dir, "vmhost.service")
	os.WriteFile(unit, []byte(strings.ReplaceAll(string(b), "/usr/bin/vmhost", binary(t))), 0o644)
	if out, err := exec.Command(analyze, "verify", unit).CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// TestDebPackage builds the package with dist/build-deb.sh and checks it
// with dpkg-deb: the control fields, the exact file list and modes, the
// conffiles, maintainer scripts that never start the agent, and the
// binary's version. lintian, when installed, must have nothing to say.
func TestDebPackage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the package (-short)")
	}
	distTool(t, "dpkg-deb", "dpkg")
	out := t.TempDir()
	cmd := exec.Command("dist/build-deb.sh")
	cmd.Env = append(os.Environ(), "VERSION=1.2.3", "OUT="+out, "GOARCH=amd64")
	b, err := cmd.Output()
	if err != nil {
		t.Fatalf("build-deb.sh: %v\n%s", err, exitStderr(err))
	}
	deb := strings.TrimSpace(string(b))
	if deb != filepath.Join(out, "vmhost_1.2.3_amd64.deb") {
		t.Fatalf("build-deb.sh printed %q", deb)
	}
	field := func(name string) string {
		b, err := exec.Command("dpkg-deb", "--field", deb, name).Output()
		if err != nil {
			t.Fatalf("dpkg-deb --field %s: %v", name, err)
		}
		return strings.TrimSpace(string(b))
	}
	for name, want := range map[string]string{
		"Package":      "vmhost",
		"Version":      "1.2.3",
		"Architecture": "amd64",
		"Depends":      "qemu-system-common, e2fsprogs",
		"Section":      "admin",
	} {
		if got := field(name); got != want {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
	if strings.Contains(field("Depends")+field("Suggests"), "nftables") {
		t.Error("the package depends on nftables, which netlink replaces")
	}

	b, err = exec.Command("dpkg-deb", "--contents", deb).Output()
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l) // mode owner size date time path
		if len(f) < 6 || strings.HasSuffix(f[5], "/") {
			continue
		}
		files = append(files, f[0]+" "+f[1]+" "+f[5])
	}
	want := []string{
		"-rw-r--r-- root/root ./etc/default/vmhost",
		"-rw-r--r-- root/root ./etc/vmhost/config.json",
		"-rw-r--r-- root/root ./lib/systemd/system/vmhost.service",
		"-rwxr-xr-x root/root ./usr/bin/vmhost",
		"-rw-r--r-- root/root ./usr/share/doc/vmhost/README.md.gz",
	}
	// Every guide of docs/ ships, compressed, as the README links them.
	docs, _ := filepath.Glob("docs/*.md")
	refs, _ := filepath.Glob("docs/ref/*.md")
	if len(docs) < 6 {
		t.Fatalf("docs/*.md: %q", docs)
	}
	for _, d := range append(docs, refs...) {
		want = append(want, "-rw-r--r-- root/root ./usr/share/doc/vmhost/"+strings.TrimPrefix(d, "docs/")+".gz")
	}
	want = append(want,
		"-rw-r--r-- root/root ./usr/share/doc/vmhost/changelog.gz",
		"-rw-r--r-- root/root ./usr/share/doc/vmhost/copyright",
		"-rw-r--r-- root/root ./usr/share/lintian/overrides/vmhost",
		"-rw-r--r-- root/root ./usr/share/man/man1/vmhost.1.gz",
	)
	slices.Sort(want)
	slices.Sort(files)
	if !slices.Equal(files, want) {
		t.Errorf("package files:\n%s\nwant:\n%s", strings.Join(files, "\n"), strings.Join(want, "\n"))
	}

	ctl := t.TempDir()
	if b, err := exec.Command("dpkg-deb", "--control", deb, ctl).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb --control: %v\n%s", err, b)
	}
	if b, _ := os.ReadFile(filepath.Join(ctl, "conffiles")); string(b) != "/etc/default/vmhost\n/etc/vmhost/config.json\n" {
		t.Errorf("conffiles = %q", b)
	}
	post, _ := os.ReadFile(filepath.Join(ctl, "postinst"))
	for _, want := range []string{"install -d -m 0700 /var/lib/vmhost", "systemctl daemon-reload", "[ -d /run/systemd/system ]"} {
		if !strings.Contains(string(post), want) {
			t.Errorf("postinst does not contain %q", want)
		}
	}
	for _, bad := range []string{"systemctl start", "systemctl enable", "restart vmhost.service\n", "rm -rf"} {
		if strings.Contains(string(post), bad) {
			t.Errorf("postinst contains %q: the agent must not start on install", bad)
		}
	}

	root := t.TempDir()
	if b, err := exec.Command("dpkg-deb", "--extract", deb, root).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb --extract: %v\n%s", err, b)
	}
	v, err := exec.Command(filepath.Join(root, "usr/bin/vmhost"), "version").Output()
	wantCommit := "commit unknown" // a checkout without git (a tarball)
	if head, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		wantCommit = "commit " + strings.TrimSpace(string(head))
	}
	if err != nil || !strings.HasPrefix(string(v), "vmhost 1.2.3\n"+wantCommit+"\n") {
		t.Errorf("packaged vmhost version = %q, %v; want 1.2.3 and %s", v, err, wantCommit)
	}
	gunzip := func(path string) string {
		b, err := exec.Command("gzip", "-dc", filepath.Join(root, path)).Output()
		if err != nil {
			t.Fatalf("gzip -dc %s: %v", path, err)
		}
		return string(b)
	}
	if man, want := gunzip("usr/share/man/man1/vmhost.1.gz"), manPage("1.2.3"); man != want {
		t.Errorf("the packaged manual page is not vmhost man of version 1.2.3:\n%s", man)
	}
	for _, d := range []string{"api.md", "operating.md"} {
		if b, _ := os.ReadFile(filepath.Join("docs", d)); gunzip("usr/share/doc/vmhost/"+d+".gz") != string(b) || len(b) == 0 {
			t.Errorf("the packaged %s is not docs/%s", d, d)
		}
	}
	cfg := filepath.Join(root, "etc/vmhost/config.json")
	def, _, _ := vmhost(t, "", "config", "default")
	if b, _ := os.ReadFile(cfg); string(b) != def || def == "" {
		t.Errorf("the packaged config.json is not vmhost config default:\n%s", b)
	}
	if out, errOut, code := vmhost(t, "", "config", "check", cfg); code != 0 {
		t.Errorf("vmhost config check on the packaged config = %d, %s%s", code, out, errOut)
	}

	distTool(t, "lintian", "lintian")
	lint := exec.Command("lintian", "--fail-on", "error,warning", deb)
	b, err = lint.CombinedOutput()
	var findings []string
	for _, l := range strings.Split(string(b), "\n") {
		if len(l) > 2 && l[1] == ':' { // E:, W:, I:, N: lines
			findings = append(findings, l)
		}
	}
	if err != nil || len(findings) > 0 {
		t.Errorf("lintian: %v\n%s", err, b)
	}
}
